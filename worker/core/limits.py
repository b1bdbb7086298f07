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
  in the message's ``lost_count``.

Signals reach only the main thread: a run on another thread arms neither limit (a
warning is logged once per process) and the handler runs unlimited, as without limits.
orderly's workers run their tasks in the main thread of prefork children.

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


def _kill_self(what: str) -> None:
    log.critical("%s: hard time limit passed; killing process %s", what, os.getpid())
    logging.shutdown()  # the log line above reaches its file before the end
    os.kill(os.getpid(), signal.SIGKILL)


# How often the watchdog thread looks at the armed deadlines.
WATCH_EVERY_S = 0.2


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
        # A forked child: the parent's thread (and the lock's state) did not come along.
        self._cond = threading.Condition()
        self._armed = {}
        self._pid = os.getpid()
        threading.Thread(target=self._run, name="orderly-watchdog", daemon=True).start()

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
    """One run under a soft limit (SIGALRM) and a hard one (the watchdog)."""

    def __init__(self, limits: TimeLimits, limit_s: float, what: str) -> None:
        self._limits = limits
        self.limit_s = limit_s
        self.what = what
        self._armed = False
        self._active = False
        self._token = 0
        self._previous_handler: Any = None
        self._previous_timer = (0.0, 0.0)
        self._started = 0.0

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if not self._armed:
            return  # the run is ending: the alarm came too late to matter
        self._armed = False  # raised once at most
        raise TimeLimitExceeded(self.limit_s, self.what)

    def start(self) -> None:
        # Nothing can interrupt this before the timer is set, its last step.
        self._started = time.monotonic()
        self._token = self._limits.watchdog.arm(self.limit_s + self._limits.grace_s, self.what)
        self._previous_handler = signal.signal(signal.SIGALRM, self._on_alarm)
        self._active = True
        self._armed = True
        self._previous_timer = signal.setitimer(signal.ITIMER_REAL, self.limit_s)

    def stop(self) -> None:
        """Idempotent: a second call completes a first one the alarm interrupted (which it
        can do only before the first statement, and only once)."""
        self._armed = False  # from here on the alarm raises nothing
        if not self._active:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        self._limits.watchdog.disarm(self._token)
        previous = self._previous_handler
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
        delay, interval = self._previous_timer
        if delay > 0:
            left = delay - (time.monotonic() - self._started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6), interval)
        self._active = False


class TimeLimits:
    """The limits of one process: the kill grace, and the watchdog that enforces it."""

    def __init__(self, grace_s: float, watchdog: Watchdog | None = None) -> None:
        if not (math.isfinite(grace_s) and grace_s > 0):
            raise ValueError(f"the hard-kill grace must be a positive number of seconds: {grace_s}")
        self.grace_s = grace_s
        self.watchdog = watchdog or Watchdog()
        self._warned = False

    def run(self, limit_s: float, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` under the limit: its result, or :class:`TimeLimitExceeded` raised inside
        it at ``limit_s``; the process killed ``grace_s`` later if it has not returned by
        then. Off the main thread ``fn`` runs unlimited (see the module's docstring)."""
        if not (math.isfinite(limit_s) and limit_s > 0):
            raise ValueError(f"a time limit must be a positive number of seconds: {limit_s}")
        if threading.current_thread() is not threading.main_thread():
            self._warn_not_main_thread(what)
            return fn()
        limited = _Limited(self, limit_s, what)
        finished: list[T] = []
        try:
            limited.start()
            try:
                finished.append(fn())
            finally:
                limited.stop()
        except TimeLimitExceeded:
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
