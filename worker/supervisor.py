"""The supervision of worker processes (``orderly worker``): a number of them run, and one that
died is started again after a back-off.

A process that dies (killed, or an exit code other than 0) is restarted after the retry
policy's wait for its restart number (worker/core/retry.py: ``delay * 2^n``, capped); one that
had run at least ``healthy_s`` before it died counts as restart 1 again. What is left of a
dead process's group (a Celery worker's pool) is killed before the new one starts. A process
that exits with 0 was told to stop (a warm shutdown: its service key deleted, ``orderly node
stop --exit``) and stays down; when all have, the supervisor ends. Stopping the supervisor
stops every process: SIGTERM to each main process alone (a Celery worker then finishes the
tasks in hand), and after a grace SIGKILL to whatever is left of each group.

The processes and the time are given (:class:`Process`, ``spawn``, a clock and a pause), so
that a test drives the loop without starting anything or sleeping.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from orderly.worker.core.clock import SYSTEM, Clock
from orderly.worker.core.retry import MAX_ATTEMPTS, RetryPolicy

log = logging.getLogger("orderly.supervisor")

# How often the supervisor looks at its processes while nothing is due.
POLL_S = 0.2


class Process(Protocol):
    pid: int

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal) once it ended, else None."""
        ...

    def terminate(self) -> None:
        """SIGTERM to the main process alone."""
        ...

    def kill_group(self) -> None:
        """SIGKILL to whatever is left of its process group."""
        ...

    def wait(self, timeout: float) -> int | None:
        """Its exit code, waiting at most ``timeout`` seconds (None: still running)."""
        ...


class Spawned:
    """A child process in a session (and process group) of its own: a Ctrl-C in the terminal
    reaches the supervisor alone, which stops its children in order."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.proc = subprocess.Popen(list(argv), start_new_session=True)
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None


def restart_policy(delay_ms: int, max_delay_ms: int) -> RetryPolicy:
    """Restart n waits ``delay_ms * 2^n``, at most ``max_delay_ms``."""
    return RetryPolicy(delay_ms, 2.0, MAX_ATTEMPTS, max_delay_ms)


def ending(code: int) -> str:
    """How a process ended, in words."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with {code}"


@dataclass
class Slot:
    index: int
    proc: Process | None = None
    started: float = 0.0
    restarts: int = 0  # restarts since it last ran healthy_s
    restart_at: float | None = None
    done: bool = False  # exited with 0: stays down


class Supervisor:
    """``count`` processes made by ``spawn(index)``, kept running."""

    def __init__(
        self,
        count: int,
        spawn: Callable[[int], Process],
        policy: RetryPolicy,
        healthy_s: float,
        *,
        clock: Clock = SYSTEM,
    ) -> None:
        if count < 1:
            raise ValueError(f"at least one process, got {count}")
        self.slots = [Slot(i) for i in range(count)]
        self.spawn = spawn
        self.policy = policy
        self.healthy_s = healthy_s
        self.clock = clock

    def _start(self, slot: Slot) -> None:
        slot.proc = self.spawn(slot.index)
        slot.started = self.clock.monotonic()
        slot.restart_at = None
        log.info("worker %d started (pid %d)", slot.index + 1, slot.proc.pid)

    def check(self) -> float | None:
        """Look at every process once: note the dead, restart those whose wait is over.
        Returns when the next restart is due (monotonic seconds), if one is waiting."""
        now = self.clock.monotonic()
        for slot in self.slots:
            if slot.done:
                continue
            if slot.proc is not None:
                code = slot.proc.poll()
                if code is None:
                    continue
                self._died(slot, code, now)
            if slot.restart_at is not None and now >= slot.restart_at:
                self._start(slot)
        waiting = [s.restart_at for s in self.slots if s.restart_at is not None]
        return min(waiting) if waiting else None

    def _died(self, slot: Slot, code: int, now: float) -> None:
        assert slot.proc is not None
        pid, ran = slot.proc.pid, now - slot.started
        # Its pool (or anything else it started) goes with it: nothing runs twice.
        slot.proc.kill_group()
        slot.proc = None
        if code == 0:
            slot.done = True
            log.warning("worker %d (pid %d) exited with 0: it stays down", slot.index + 1, pid)
            return
        if ran >= self.healthy_s:
            slot.restarts = 0
        slot.restarts += 1
        wait_s = self.policy.delay(min(slot.restarts, MAX_ATTEMPTS)) / 1000
        slot.restart_at = now + wait_s
        log.warning(
            "worker %d (pid %d) %s after %.1f s: restart %d in %.3f s",
            slot.index + 1,
            pid,
            ending(code),
            ran,
            slot.restarts,
            wait_s,
        )

    @property
    def finished(self) -> bool:
        """Every process exited with 0."""
        return all(s.done for s in self.slots)

    def run(self, pause: Callable[[float], bool], poll_s: float = POLL_S) -> int:
        """Start every process and keep them running until ``pause`` (which waits up to the
        seconds it is given) says to stop, or all exited with 0; then stop them. 0."""
        for slot in self.slots:
            self._start(slot)
        try:
            while True:
                due = self.check()
                if self.finished:
                    log.info("every worker exited with 0: the supervisor ends")
                    return 0
                wait = poll_s
                if due is not None:
                    wait = max(0.0, min(poll_s, due - self.clock.monotonic()))
                if pause(wait):
                    return 0
        finally:
            self.stop()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to each running process; SIGKILL to what is left of each after the grace."""
        running = [s.proc for s in self.slots if s.proc is not None]
        for proc in running:
            proc.terminate()
        deadline = self.clock.monotonic() + grace_s
        for proc in running:
            proc.wait(deadline - self.clock.monotonic())
            proc.kill_group()
        for slot in self.slots:
            slot.proc = None


def follow_parent(parent: int) -> bool:
    """This process gets SIGTERM when its parent (the supervisor) dies, even by SIGKILL (Linux's
    parent-death signal): no worker outlives its supervisor. False when the parent is gone
    already."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    return os.getppid() == parent
