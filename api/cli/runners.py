"""``orderly api|worker|beat|flower|up``: orderly's processes, started with its settings applied.

``orderly api`` is uvicorn serving the app factory on ``ORDERLY_API_HOST:ORDERLY_API_PORT``;
``orderly beat`` and ``orderly flower`` are Celery's own commands on orderly's Celery app
(``celery -A orderly.worker ...`` does the same). ``orderly worker`` supervises
ORDERLY_WORKER_PROCESSES Celery workers (worker/supervisor.py): one that dies is started again
after a back-off, and a SIGTERM or Ctrl-C stops them all. ``orderly up`` runs the API, a
worker and beat as one group for a development machine: one log stream, each line prefixed
with its process, and Ctrl-C (or SIGTERM) stops all three.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Annotated

import typer

from orderly.api.cli.common import require_extra
from orderly.worker.runtime import get_runtime
from orderly.worker.settings import get_settings
from orderly.worker.supervisor import Spawned, Supervisor, follow_parent, restart_policy

# How long ``orderly up`` gives its processes to stop after SIGTERM before SIGKILL.
STOP_GRACE_S = 20.0


def api(
    host: Annotated[str | None, typer.Option(help="Default: ORDERLY_API_HOST.")] = None,
    port: Annotated[int | None, typer.Option(help="Default: ORDERLY_API_PORT.")] = None,
    access_log: Annotated[bool, typer.Option(help="One log line per request.")] = False,
    workers: Annotated[
        int | None, typer.Option(min=1, max=64, help="Processes. Default: ORDERLY_API_WORKERS.")
    ] = None,
) -> None:
    """The HTTP API (uvicorn) on ORDERLY_API_HOST:ORDERLY_API_PORT."""
    import uvicorn

    settings = get_settings()
    uvicorn.run(
        "orderly.api.http:create_app",
        factory=True,
        host=host or settings.api_host,
        port=port or settings.api_port,
        log_level=settings.log_level.lower(),
        access_log=access_log,
        workers=workers or settings.api_workers,
    )


def _celery(*argv: str) -> None:
    # In the JSON log format nothing but log records on the streams: no banner.
    quiet = ["--quiet"] if get_settings().log_format == "json" else []
    # Celery's exit code (a worker that failed to start, a cold shutdown) is this command's:
    # a supervisor (docker-compose's on-failure, orderly up) must see it.
    code = get_runtime().broker.run_command([*quiet, *argv])
    if isinstance(code, int) and code:
        raise typer.Exit(code=code)


def worker(
    concurrency: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=1000,
            help="Tasks each worker runs at once, its pool processes. "
            "Default: AURA_QUEUE_MANAGER_CONCURRENT, at most the machine's cores.",
        ),
    ] = None,
    queues: Annotated[
        str | None, typer.Option("--queues", "-Q", help="Comma-separated (default: all).")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", "-n", help="Node name.")] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Celery workers to run and restart. Default: ORDERLY_WORKER_PROCESSES.",
        ),
    ] = None,
    supervised_by: Annotated[int | None, typer.Option(hidden=True)] = None,
) -> None:
    """Celery workers of orderly's tasks (processing, deliveries, drains, agents), restarted
    when they die."""
    options: list[str] = []
    if concurrency is not None:
        options += ["--concurrency", str(concurrency)]
    if queues:
        options += ["-Q", queues]
    if supervised_by is not None:
        # One supervised Celery worker: it goes when its supervisor goes.
        if not follow_parent(supervised_by):
            raise typer.Exit(code=1)
        argv = ["worker", "--loglevel", get_settings().log_level, *options]
        _celery(*argv, *(["-n", name] if name else []))
        return
    settings = get_settings()
    count = processes or settings.worker_processes
    # -P: orderly's own modules, not those of a directory it is started in.
    me = [
        sys.executable,
        "-P",
        "-m",
        "orderly.api.cli",
        "worker",
        "--supervised-by",
        str(os.getpid()),
    ]

    def spawn(index: int) -> Spawned:
        own = _node_name(name, index, count)
        return Spawned([*me, *options, *(["-n", own] if own else [])])

    supervisor = Supervisor(
        count,
        spawn,
        restart_policy(settings.worker_restart_delay_ms, settings.worker_restart_max_delay_ms),
        settings.worker_healthy_ms / 1000,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    supervisor.run(stop.wait)


def _node_name(name: str | None, index: int, count: int) -> str | None:
    """The Celery node name of worker ``index``: the one given (or Celery's default) for a
    single worker, else one per worker (``name-2@host``, ``worker-2@%h``)."""
    if count == 1:
        return name
    base, _, host = (name or "worker").partition("@")
    return f"{base}-{index + 1}@{host or '%h'}"


def beat() -> None:
    """Celery beat: the ticker of due work and the periodic agents (run exactly one)."""
    _celery("beat", "--loglevel", get_settings().log_level)


def flower() -> None:
    """Flower, Celery's dashboard, behind ORDERLY_FLOWER_USER/PASSWORD on
    ORDERLY_FLOWER_ADDRESS:ORDERLY_FLOWER_PORT (needs the dashboard extra)."""
    require_extra("dashboard", "flower")
    _celery("flower")


def _pump(name: str, stream: IO[str], lock: threading.Lock) -> None:
    """Copy a child's lines to the one stream, prefixed; read to the end whatever happens to
    the writes, so that a child never blocks on a full pipe."""
    width = len("worker")
    for line in stream:
        with lock, contextlib.suppress(OSError):
            sys.stdout.write(f"{name:<{width}} | {line}")
            sys.stdout.flush()


def up(
    concurrency: Annotated[int, typer.Option(help="The worker's processes.")] = 2,
) -> None:
    """API, a worker and beat in one group, one log stream; Ctrl-C stops all three."""
    # -P: orderly's own modules, not those of a directory it is started in.
    me = [sys.executable, "-P", "-m", "orderly.api.cli"]
    commands = {
        "api": [*me, "api"],
        "worker": [*me, "worker", "--concurrency", str(concurrency)],
        "beat": [*me, "beat"],
    }
    lock = threading.Lock()
    stop = threading.Event()
    procs: dict[str, subprocess.Popen[str]] = {}
    pumps: list[threading.Thread] = []

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(signum, on_signal)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        for name, argv in commands.items():
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                env=env,
                # Their own group: a Ctrl-C in the terminal reaches ``up`` alone, which stops
                # them in order.
                start_new_session=True,
            )
            procs[name] = proc
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(name, proc.stdout, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        while not stop.is_set():
            ended = [n for n, p in procs.items() if p.poll() is not None]
            if ended:
                with lock:
                    print(f"orderly up: {', '.join(ended)} exited; stopping the others", flush=True)
                break
            stop.wait(0.5)
    finally:
        _stop_all(procs)
        for pump in pumps:  # their last lines (the shutdown) reach the stream
            pump.join(5)
    failed = {n: p.returncode for n, p in procs.items() if p.returncode not in (0, -15)}
    if failed and not stop.is_set():
        raise typer.Exit(code=1)


def _stop_all(procs: dict[str, subprocess.Popen[str]]) -> None:
    # SIGTERM to each process alone: a worker then stops its pool after the tasks in hand
    # (a warm shutdown); its pool children would die at once if the group were signalled.
    for proc in procs.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.1, deadline - time.monotonic()))
        # Whatever is left of its group (a worker's pool children): nothing stays behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
