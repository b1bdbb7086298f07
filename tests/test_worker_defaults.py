"""A default ``orderly worker`` fits the machine it starts on: its pool has no more processes
than cores (AURA_QUEUE_MANAGER_CONCURRENT is the ceiling, not the count), so on two cores the
supervisor, the Celery worker and its pool are four processes, under 600 MB together."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from orderly.worker.settings import Settings
from tests.helpers import processes_with, wait_until
from tooling.processes import BIN


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.e2e
def test_a_default_worker_forks_no_more_processes_than_cores(
    db: object, redis_client: object, tmp_path: Path
) -> None:
    marker = f"defaults-{uuid.uuid4().hex[:10]}"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AURA_QUEUE_MANAGER_CONCURRENT", "ORDERLY_WORKER_PROCESSES"))
    }
    env.update(ORDERLY_NODE_CODE=marker, ORDERLY_DEFAULTS_TEST_MARKER=marker)
    cores = len(os.sched_getaffinity(0))
    pool = min(Settings().concurrent, cores)
    assert Settings().concurrent == 25  # the seed's default is in force
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(BIN / "orderly"), "worker"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: "ready." in log.read_text(), 120, "the worker ready")
        # the supervisor, the Celery worker and its pool
        wait_until(lambda: len(processes_with(marker)) >= 2 + pool, 30, "the pool forked")
        pids = processes_with(marker)
        assert len(pids) == 2 + pool, log.read_text()[-2000:]
        rss = sum(_rss_mb(pid) for pid in pids)
        if cores <= 2:
            assert len(pids) <= 4
            assert rss < 600, f"{rss:.0f} MB"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
