"""Start and stop orderly's processes (API, workers, beat) as real subprocesses.

Used by the main job, the benchmarks and the end-to-end tests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def checkout_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the checkout on PYTHONPATH: the installed orderly imports the demo's and the
    tests' handler modules (``tooling.handlers``, ``tests.*``), which are not in the wheel."""
    paths = [str(ROOT), *(p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**base, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


@dataclass
class Managed:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class ProcessGroup:
    """Processes started together and stopped together (in reverse order)."""

    env: dict[str, str]
    log_dir: Path
    procs: list[Managed] = field(default_factory=list)

    @classmethod
    def create(cls, log_dir: Path, env: Mapping[str, str] | None = None) -> ProcessGroup:
        log_dir.mkdir(parents=True, exist_ok=True)
        merged = checkout_env(os.environ)
        merged.update(env or {})
        return cls(env=merged, log_dir=log_dir)

    def start(
        self,
        name: str,
        argv: list[str],
        extra_env: Mapping[str, str] | None = None,
        *,
        cwd: Path | None = None,
    ) -> Managed:
        log_path = self.log_dir / f"{name}.log"
        env = dict(self.env)
        env.update(extra_env or {})
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                argv,
                cwd=cwd or ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        managed = Managed(name, proc, log_path)
        self.procs.append(managed)
        return managed

    def start_worker(
        self,
        name: str,
        *,
        concurrency: int | None = 2,
        pool: str = "prefork",
        node_code: str | None = None,
        queues: str | None = None,
        prefetch: int | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> Managed:
        """A Celery worker; ``concurrency`` None leaves it to AURA_QUEUE_MANAGER_CONCURRENT;
        ``prefetch`` overrides the prefetch multiplier (AURA_QUEUE_MANAGER_CONCURRENT_FACTOR;
        1: a busy process holds no task besides the one it runs, since tasks are acknowledged
        late)."""
        argv = [
            str(BIN / "celery"),
            "-A",
            "orderly.worker",
            "worker",
            "-n",
            f"{name}@%h",
            "--pool",
            pool,
            *(["--concurrency", str(concurrency)] if concurrency is not None else []),
            "--loglevel",
            "INFO",
            "--without-mingle",
            "--without-gossip",
        ]
        if queues:
            argv += ["-Q", queues]
        if prefetch is not None:
            argv += ["--prefetch-multiplier", str(prefetch)]
        env = dict(extra_env or {})
        if node_code:
            env["ORDERLY_NODE_CODE"] = node_code
        return self.start(name, argv, env)

    def start_beat(self, name: str = "beat", extra_env: Mapping[str, str] | None = None) -> Managed:
        argv = [str(BIN / "celery"), "-A", "orderly.worker", "beat", "--loglevel", "INFO"]
        return self.start(name, argv, extra_env)

    def start_api(
        self,
        port: int,
        name: str = "api",
        extra_env: Mapping[str, str] | None = None,
        workers: int = 1,
    ) -> Managed:
        argv = [
            str(BIN / "uvicorn"),
            "orderly.api.http:create_app",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
            "--workers",
            str(workers),
        ]
        managed = self.start(name, argv, extra_env)
        wait_http(f"http://127.0.0.1:{port}/health", managed)
        return managed

    def stop(self, managed: Managed, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if managed.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(managed.proc.pid, sig)
            try:
                managed.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(managed.proc.pid, signal.SIGKILL)
                managed.proc.wait(10)

    def stop_all(self) -> None:
        for managed in reversed(self.procs):
            self.stop(managed)
        self.procs.clear()


def free_port() -> int:
    """A TCP port nobody listens on now, for a process about to start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, managed: Managed, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not managed.alive():
            raise RuntimeError(f"{managed.name} exited; see {managed.log_path}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{managed.name} did not answer {url} within {timeout}s")


def wait_for_log(managed: Managed, needle: str, timeout: float = 30.0) -> None:
    """Wait until a process has written ``needle`` to its log (e.g. 'ready.')."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in managed.log_path.read_text(errors="replace"):
            return
        if not managed.alive():
            raise RuntimeError(f"{managed.name} exited; see {managed.log_path}")
        time.sleep(0.1)
    raise RuntimeError(f"{managed.name} did not log {needle!r} within {timeout}s")
