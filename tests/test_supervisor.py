"""``orderly worker`` supervises its Celery workers: one that died is started again after an
exponential, capped back-off that starts anew after a healthy run; one that exits with 0
stays down; a SIGTERM to the supervisor stops them all, leaving nothing behind.

The back-off is measured on the supervision loop with a clock and a pause of the test's own;
the end-to-end tests kill real workers and watch new ones take messages."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from orderly.worker.settings import Settings
from orderly.worker.supervisor import Supervisor, ending, restart_policy
from tests.helpers import ManualClock, message, processes_with, wait_until
from tests.stack import START_TIMEOUT_S, Stack
from tooling.processes import BIN, Managed, ProcessGroup

# --- the supervision loop, on a clock of the test's own -------------------------------------


class FakeProcess:
    """Runs ``life`` seconds of the test's clock, then ends with ``code``."""

    def __init__(self, clock: ManualClock, pid: int, life: float, code: int) -> None:
        self.clock, self.pid, self.code = clock, pid, code
        self.ends = clock.monotonic() + life
        self.seen_dead: float | None = None  # when the supervisor first saw it ended
        self.signals: list[str] = []

    def poll(self) -> int | None:
        if "TERM" in self.signals or self.clock.monotonic() >= self.ends:
            if self.seen_dead is None:
                self.seen_dead = self.clock.monotonic()
            return self.code
        return None

    def terminate(self) -> None:
        self.signals.append("TERM")
        self.code = 0

    def kill_group(self) -> None:
        self.signals.append("KILL")

    def wait(self, timeout: float) -> int | None:
        return self.poll()


class Harness:
    """Processes of the given lives (seconds, exit code), then one that stays."""

    def __init__(self, lives: list[tuple[float, int]]) -> None:
        self.clock = ManualClock()
        self.lives = list(lives)
        self.started: list[FakeProcess] = []
        self.starts: list[float] = []

    def spawn(self, index: int) -> FakeProcess:
        life, code = self.lives.pop(0) if self.lives else (1e9, 0)
        self.starts.append(self.clock.monotonic())
        proc = FakeProcess(self.clock, 100 + len(self.started), life, code)
        self.started.append(proc)
        return proc

    def pause(self, seconds: float) -> bool:
        """The supervisor's wait: the clock moves on; stop once the one that stays started."""
        self.clock.advance(seconds)
        return not self.lives and self.started[-1].ends - self.clock.monotonic() > 1e8

    def restart_waits(self) -> list[float]:
        """Seconds from each death the supervisor saw to the next start."""
        return [
            round(start - dead.seen_dead, 3)
            for dead, start in zip(self.started, self.starts[1:], strict=False)
            if dead.seen_dead is not None
        ]


def ticking(clock: ManualClock, answers: list[bool]) -> Callable[[float], bool]:
    """A pause that moves the clock on and answers as told (stop or not), then False."""
    told = iter(answers)

    def pause(seconds: float) -> bool:
        clock.advance(seconds)
        return next(told, False)

    return pause


def run(lives: list[tuple[float, int]], delay_ms: int, max_ms: int, healthy_s: float) -> Harness:
    h = Harness(lives)
    policy = restart_policy(delay_ms, max_ms)
    supervisor = Supervisor(1, h.spawn, policy, healthy_s, clock=h.clock)
    assert supervisor.run(h.pause) == 0
    return h


def test_restarts_back_off_exponentially_up_to_the_cap_and_anew_after_a_healthy_run() -> None:
    crash = (0.0, -9)
    # Eight crashes at once, a run of 100 s (healthy: 60 s), a crash, then a worker that stays.
    h = run([crash] * 8 + [(100.0, 1), crash], delay_ms=500, max_ms=30_000, healthy_s=60)
    # Restart n waits 500 ms * 2^n, at most 30 s; after the healthy run it is restart 1 again.
    assert h.restart_waits() == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 1.0, 2.0]
    # Every dead worker's group was killed (its pool) before the next one started.
    assert all("KILL" in p.signals for p in h.started[:-1])


def test_other_settings_change_the_waits() -> None:
    crash = (0.0, 1)
    h = run([crash] * 4 + [(5.0, 1), crash], delay_ms=100, max_ms=1000, healthy_s=3)
    assert h.restart_waits() == [0.2, 0.4, 0.8, 1.0, 0.2, 0.4]
    # A run shorter than the healthy period keeps the back-off going.
    h = run([crash] * 2 + [(2.0, 1), crash], delay_ms=100, max_ms=1000, healthy_s=3)
    assert h.restart_waits() == [0.2, 0.4, 0.8, 1.0]


def test_a_worker_that_exits_with_0_stays_down_and_the_supervisor_ends() -> None:
    h = Harness([(3.0, 0)])
    supervisor = Supervisor(1, h.spawn, restart_policy(500, 30_000), 60, clock=h.clock)
    assert supervisor.run(ticking(h.clock, [])) == 0
    assert len(h.started) == 1 and supervisor.finished


def test_stopping_terms_each_worker_then_kills_what_is_left() -> None:
    h = Harness([(1e9, 0), (1e9, 0)])
    supervisor = Supervisor(2, h.spawn, restart_policy(500, 30_000), 60, clock=h.clock)
    assert supervisor.run(ticking(h.clock, [False, False, True])) == 0
    assert [p.signals for p in h.started] == [["TERM", "KILL"], ["TERM", "KILL"]]
    assert ending(-9) == "was killed by SIGKILL" and ending(3) == "exited with 3"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"ORDERLY_WORKER_PROCESSES": "0"}, "greater than or equal to 1"),
        ({"ORDERLY_WORKER_PROCESSES": "many"}, "ORDERLY_WORKER_PROCESSES"),
        ({"ORDERLY_WORKER_RESTART_DELAY_MS": "0"}, "ORDERLY_WORKER_RESTART_DELAY_MS"),
        (
            {
                "ORDERLY_WORKER_RESTART_DELAY_MS": "5000",
                "ORDERLY_WORKER_RESTART_MAX_DELAY_MS": "10",
            },
            "may not be shorter",
        ),
        ({"ORDERLY_WORKER_HEALTHY_MS": "-1"}, "ORDERLY_WORKER_HEALTHY_MS"),
    ],
)
def test_bad_supervisor_settings_are_refused(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], needle: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert needle in str(info.value)


# --- real workers ----------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (its supervised workers)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(p) for p in path.read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"


def start_supervisor(procs: ProcessGroup, marker: str, processes: int, **env: str) -> Managed:
    """``orderly worker`` (restart n waits 100 ms * 2^n unless ``env`` says otherwise)."""
    settings = {
        "ORDERLY_NODE_CODE": "supervised",
        "ORDERLY_WORKER_PROCESSES": str(processes),
        "ORDERLY_WORKER_RESTART_DELAY_MS": "100",
        "ORDERLY_TEST_SUPERVISOR": marker,
        **env,
    }
    argv = [str(BIN / "orderly"), "worker", "--concurrency", "1"]
    return procs.start("worker", argv, settings)


def ready_count(managed: Managed) -> int:
    return managed.log_path.read_text(errors="replace").count(" ready.")


def test_a_killed_worker_is_started_again_and_takes_messages(stack: Stack) -> None:
    marker = uuid.uuid4().hex
    stack.start_api()
    supervisor = start_supervisor(stack.procs, marker, processes=1)
    wait_until(lambda: ready_count(supervisor) == 1, START_TIMEOUT_S, "the worker ready")
    (first,) = children(supervisor.proc.pid)
    pool = children(first)
    assert pool  # its pool process
    os.killpg(first, signal.SIGKILL)  # the whole worker: its main process and its pool
    wait_until(lambda: ready_count(supervisor) == 2, START_TIMEOUT_S, "a new worker ready")
    (second,) = children(supervisor.proc.pid)
    assert second != first and not any(alive(p) for p in [first, *pool])
    os.killpg(second, signal.SIGKILL)
    wait_until(lambda: ready_count(supervisor) == 3, START_TIMEOUT_S, "a third worker ready")
    said = supervisor.log_path.read_text()
    # ORDERLY_WORKER_RESTART_DELAY_MS 100: restart n waits 100 ms * 2^n.
    assert "was killed by SIGKILL" in said
    assert "restart 1 in 0.200 s" in said and "restart 2 in 0.400 s" in said
    msg_id = stack.submit(message(1, operation="say", payload="after the restart"))
    stack.wait_state(msg_id, "OK", timeout=60)
    assert supervisor.alive()


def test_several_workers_and_a_sigterm_that_stops_them_all(stack: Stack) -> None:
    marker = uuid.uuid4().hex
    stack.start_api()
    # Restarts capped at 150 ms, and every worker healthy after 1 ms: each restart is the first.
    supervisor = start_supervisor(
        stack.procs,
        marker,
        processes=2,
        ORDERLY_WORKER_RESTART_MAX_DELAY_MS="150",
        ORDERLY_WORKER_HEALTHY_MS="1",
    )
    wait_until(lambda: ready_count(supervisor) == 2, START_TIMEOUT_S, "two workers ready")
    mains = children(supervisor.proc.pid)
    assert len(mains) == 2  # ORDERLY_WORKER_PROCESSES
    # The main process alone killed: the supervisor kills what is left of it (its pool).
    pool = children(mains[0])
    os.kill(mains[0], signal.SIGKILL)
    wait_until(lambda: ready_count(supervisor) == 3, START_TIMEOUT_S, "the worker replaced")
    wait_until(lambda: not any(alive(p) for p in pool), 30, "the dead worker's pool gone")
    (replaced,) = set(children(supervisor.proc.pid)) - {mains[1]}
    os.kill(replaced, signal.SIGKILL)
    wait_until(lambda: ready_count(supervisor) == 4, START_TIMEOUT_S, "replaced again")
    said = supervisor.log_path.read_text()
    assert said.count("restart 1 in 0.150 s") == 2 and "restart 2" not in said
    msg_id = stack.submit(message(2, operation="say", payload="two workers"))
    stack.wait_state(msg_id, "OK", timeout=60)
    everything = processes_with(marker)
    assert len(everything) >= 5  # the supervisor, two workers, their pools
    supervisor.proc.send_signal(signal.SIGTERM)  # the supervisor alone
    assert supervisor.proc.wait(60) == 0
    wait_until(lambda: not processes_with(marker), 30, "no worker left behind")


def test_workers_go_when_the_supervisor_is_killed(procs: ProcessGroup) -> None:
    """Even a SIGKILL to the supervisor leaves no worker running (the parent-death signal)."""
    marker = uuid.uuid4().hex
    supervisor = start_supervisor(procs, marker, processes=1)
    wait_until(lambda: ready_count(supervisor) == 1, START_TIMEOUT_S, "the worker ready")
    os.kill(supervisor.proc.pid, signal.SIGKILL)
    supervisor.proc.wait(10)
    wait_until(lambda: not processes_with(marker), 60, "the orphaned worker gone")


@pytest.mark.e2e
def test_the_worker_command_says_how_it_is_supervised() -> None:
    done = subprocess.run(
        [str(BIN / "orderly"), "worker", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "--processes" in done.stdout and "ORDERLY_WORKER_PROCESSES" in done.stdout
    assert "--supervised-by" not in done.stdout
