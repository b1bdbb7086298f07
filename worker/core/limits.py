"""Time limits that stop a handler instead of letting it run beside its retry.

A handler runs under :meth:`TimeLimits.run`:

- the **soft limit**: at ``limit_s`` a SIGALRM (``setitimer(ITIMER_REAL)``) raises
  :class:`TimeLimitExceeded` inside the handler, wherever it is in Python code (a
  ``time.sleep`` or a socket wait is interrupted too). It is a ``BaseException``, so a
  handler's ``except Exception`` does not swallow it. The previous SIGALRM handler and timer
  are restored when the run ends (a timer that fell due meanwhile fires at once then).
- the **hard limit**: ``grace_s`` after the soft limit, if the run has still not ended (the
  handler swallowed the exception, or it is stuck in native code that never returns to the
  interpreter), the :class:`Watchdog` thread kills this process with SIGKILL. Whatever the
  process was doing is then a dead worker's: its claim is released by the orphan job, counted
  in the message's ``lost_count`` when the claim held it alone (a claim of several is
  isolated instead: each message is claimed alone from then on).

An **abort** (:class:`Abort`, set from any thread: worker.messages.abort's listener, when the
message is cancelled) stops a run the same way: the run sees it at once (``Abort.is_set``, a
cooperative handler returns), and ``Abort.grace_s`` later, if it still runs, the SIGALRM
timer raises :class:`Aborted` inside it, with the kill grace of the hard limit after that
(the watchdog). A run whose abort was set ends with :class:`Aborted` however it ended (its
result, or what it raised, is dropped); a run aborted before it began does not begin. A run
without a time limit is abortable too: the SIGALRM handler is installed for the run, no
timer set until an abort comes.

Signals reach only the main thread: a run on another thread arms neither limit (a
warning is logged once per process) and the handler runs unlimited, as without limits; an
abort there is only seen by a handler that looks. orderly's workers run their tasks in the
main thread of prefork children.

The limits measure real elapsed time on purpose (like the outbound client's deadline): a
handler stuck for real must be stopped for real. No Celery here: the processor uses it.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class TimeLimitExceeded(BaseException):
    """Raised inside a handler that ran past its soft time limit."""

    def __init__(self, limit_s: float, what: str = "") -> None:
        self.limit_s = limit_s
        self.what = what
        name = f"{what} " if what else ""
        super().__init__(f"{name}ran past its time limit of {limit_s:g} s")


class Aborted(BaseException):
    """Raised inside a run still going ``grace_s`` after its abort, and by
    :meth:`TimeLimits.run` for any run whose abort was set, however it ended."""

    def __init__(self, what: str = "", grace_s: float | None = None) -> None:
        self.what = what
        self.grace_s = grace_s  # None: it ended by itself (or never began)
        name = f"{what} " if what else ""
        late = "" if grace_s is None else f"; still running {grace_s:g} s after it, stopped"
        super().__init__(f"{name}aborted{late}")


class Abort:
    """The request to stop one run, made once from any thread; :meth:`TimeLimits.run` takes it.

    ``grace_s``: how long the run has to return by itself before :class:`Aborted` is raised
    inside it (0: at once)."""

    def __init__(self, grace_s: float) -> None:
        if not (math.isfinite(grace_s) and grace_s >= 0):
            raise ValueError(f"an abort grace must be zero or more seconds: {grace_s}")
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._set = False
        self._target: Callable[[float], None] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> bool:
        """Abort the run; False when it was aborted already."""
        with self._lock:
            if self._set:
                return False
            self._set = True
            target = self._target
        # Outside the lock: the target takes the run's lock, whose holder may detach.
        if target is not None:
            target(self.grace_s)
        return True

    def _attach(self, target: Callable[[float], None]) -> None:
        """``target(grace_s)`` is called once the abort is set (at once if it is)."""
        with self._lock:
            self._target = target
            fire = self._set
        if fire:
            target(self.grace_s)

    def _detach(self) -> None:
        with self._lock:
            self._target = None


def _kill_self(what: str) -> None:
    log.critical("%s: hard time limit passed; killing process %s", what, os.getpid())
    logging.shutdown()  # the log line above reaches its file before the end
    os.kill(os.getpid(), signal.SIGKILL)


# How often the watchdog thread looks at the armed deadlines.
WATCH_EVERY_S = 0.2

# Guards a watchdog's thread start; a module lock, since after a fork a watchdog's own state
# is what is being replaced. Held only while a process starts its thread.
_START_LOCK = threading.Lock()


class Watchdog:
    """One thread per process that ends the process when an armed deadline passes.

    ``kill`` is what ending means (SIGKILL to this process by default; a test gives its own).
    A child forked after the thread started gets a fresh thread on its first :meth:`arm`.
    """

    def __init__(self, kill: Callable[[str], None] = _kill_self) -> None:
        self._kill = kill
        self._tokens = itertools.count(1)
        self._pid = -1
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, str]] = {}

    def _ensure_thread(self) -> None:
        if self._pid == os.getpid():
            return
        with _START_LOCK:  # the main thread arms, and an abort's listener thread may
            if self._pid == os.getpid():
                return
            # A forked child: the parent's thread (and the lock's state) did not come along.
            self._cond = threading.Condition()
            self._armed = {}
            threading.Thread(target=self._run, name="orderly-watchdog", daemon=True).start()
            self._pid = os.getpid()

    def arm(self, after_s: float, what: str) -> int:
        """Kill the process ``after_s`` from now unless :meth:`disarm` comes first."""
        self._ensure_thread()
        token = next(self._tokens)
        with self._cond:
            self._armed[token] = (time.monotonic() + after_s, what)
        return token

    def disarm(self, token: int) -> None:
        with self._cond:
            self._armed.pop(token, None)

    def armed(self) -> int:
        """How many deadlines are armed now."""
        with self._cond:
            return len(self._armed)

    def _run(self) -> None:
        # The thread looks every WATCH_EVERY_S rather than being woken by each arm and disarm:
        # a handler call then costs no thread switch, and a kill comes at most that late.
        with self._cond:
            while True:
                if not self._armed:
                    self._cond.wait(WATCH_EVERY_S)
                    continue
                token, (deadline, what) = min(self._armed.items(), key=lambda kv: kv[1][0])
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(min(left, WATCH_EVERY_S))
                    continue
                self._armed.pop(token, None)
                self._kill(what)


class _Limited:
    """One run under a soft limit (SIGALRM) and a hard one (the watchdog), and its abort.

    One timer serves both: it is set to whichever of the limit and the abort's grace ends
    first, and the alarm handler raises what is due then and sets it again for the other."""

    def __init__(
        self, limits: TimeLimits, limit_s: float | None, what: str, abort: Abort | None
    ) -> None:
        self._limits = limits
        self.limit_s = limit_s
        self.what = what
        self._abort = abort
        # Taken by stop() and by the abort's thread; never by the alarm handler.
        self._lock = threading.Lock()
        self._armed = False
        self._active = False
        self._tokens: list[int] = []
        self._limit_at: float | None = None
        self._abort_at: float | None = None
        self._previous_handler: Any = None
        self._previous_timer = (0.0, 0.0)
        self._started = 0.0

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if not self._armed:
            return  # the run is ending: the alarm came too late to matter
        now = time.monotonic()
        abort_at, limit_at = self._abort_at, self._limit_at
        if abort_at is not None and now >= abort_at - _EARLY_S:
            self._abort_at = self._limit_at = None  # raised once at most
            assert self._abort is not None
            raise Aborted(self.what, self._abort.grace_s)
        if limit_at is not None and now >= limit_at - _EARLY_S:
            self._limit_at = None  # raised once at most
            self._set_timer(now)  # an abort after the limit is still raised when due
            raise TimeLimitExceeded(self.limit_s or 0.0, self.what)
        self._set_timer(now)  # early, or an abort's timer moved: set again

    def _set_timer(self, now: float) -> None:
        due = [at for at in (self._limit_at, self._abort_at) if at is not None]
        if due:
            signal.setitimer(signal.ITIMER_REAL, max(min(due) - now, 1e-6))

    def start(self) -> None:
        # Nothing can interrupt this before the timer is set, next to last; the abort's
        # attachment, last, may set it again (at once when the abort came first).
        self._started = time.monotonic()
        if self.limit_s is not None:
            self._limit_at = self._started + self.limit_s
            kill_s = self.limit_s + self._limits.grace_s
            self._tokens.append(self._limits.watchdog.arm(kill_s, self.what))
        self._previous_handler = signal.signal(signal.SIGALRM, self._on_alarm)
        self._active = True
        self._armed = True
        self._previous_timer = signal.setitimer(signal.ITIMER_REAL, self.limit_s or 0.0)
        if self._abort is not None:
            self._abort._attach(self._aborted)

    def _aborted(self, grace_s: float) -> None:
        """The abort was set (on any thread): its timer, and the hard limit after it."""
        with self._lock:
            if not (self._active and self._armed):
                return
            now = time.monotonic()
            self._abort_at = now + grace_s
            self._tokens.append(
                self._limits.watchdog.arm(grace_s + self._limits.grace_s, f"{self.what} aborted")
            )
            self._set_timer(now)

    def stop(self) -> None:
        """Idempotent: a second call completes a first one the alarm interrupted (which it
        can do only before the first statement, and only once)."""
        self._armed = False  # from here on the alarm raises nothing
        if self._abort is not None:
            self._abort._detach()
        with self._lock:
            if not self._active:
                return
            signal.setitimer(signal.ITIMER_REAL, 0)
            for token in self._tokens:
                self._limits.watchdog.disarm(token)
            previous = self._previous_handler
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
            delay, interval = self._previous_timer
            if delay > 0:
                left = delay - (time.monotonic() - self._started)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6), interval)
            self._active = False


# An alarm this early is taken as on time (a timer may fire a hair before the monotonic
# clock reaches the deadline).
_EARLY_S = 0.001


class TimeLimits:
    """The limits of one process: the kill grace, and the watchdog that enforces it."""

    def __init__(self, grace_s: float, watchdog: Watchdog | None = None) -> None:
        if not (math.isfinite(grace_s) and grace_s > 0):
            raise ValueError(f"the hard-kill grace must be a positive number of seconds: {grace_s}")
        self.grace_s = grace_s
        self.watchdog = watchdog or Watchdog()
        self._warned = False

    def run(
        self, limit_s: float | None, what: str, fn: Callable[[], T], abort: Abort | None = None
    ) -> T:
        """``fn()`` under the limit: its result, or :class:`TimeLimitExceeded` raised inside
        it at ``limit_s``; the process killed ``grace_s`` later if it has not returned by
        then. ``limit_s`` None: no limit. ``abort``: once it is set the run ends with
        :class:`Aborted` (see the module's docstring). Off the main thread ``fn`` runs
        unlimited, and only sees its abort if it looks."""
        if limit_s is not None and not (math.isfinite(limit_s) and limit_s > 0):
            raise ValueError(f"a time limit must be a positive number of seconds: {limit_s}")
        if abort is None:
            return self._run(limit_s, what, fn, None)
        if abort.is_set():
            raise Aborted(what)  # aborted before it began: it does not begin
        try:
            result = self._run(limit_s, what, fn, abort)
        except (Exception, TimeLimitExceeded) as exc:
            if abort.is_set():
                raise Aborted(what) from exc
            raise
        if abort.is_set():
            raise Aborted(what)  # returned when it saw the abort: its result is dropped
        return result

    def _run(self, limit_s: float | None, what: str, fn: Callable[[], T], abort: Abort | None) -> T:
        if limit_s is None and abort is None:
            return fn()
        if threading.current_thread() is not threading.main_thread():
            if limit_s is not None:
                self._warn_not_main_thread(what)
            return fn()
        limited = _Limited(self, limit_s, what, abort)
        finished: list[T] = []
        try:
            limited.start()
            try:
                finished.append(fn())
            finally:
                limited.stop()
        except (TimeLimitExceeded, Aborted):
            # An alarm that fell due as fn returned (before the stop) does not undo its result.
            if not finished:
                raise
        finally:
            limited.stop()  # completes a stop the alarm interrupted; a no-op otherwise
        return finished[0]

    def _warn_not_main_thread(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "%s runs outside the main thread: its time limit cannot be enforced there",
                what or "a handler",
            )
