"""The main job: a real end-to-end run on the local services.

Migrates, starts the API, workers and beat as processes, submits messages across several
services whose handlers fail now and then, shows progress, prints the final state counts
from PostgreSQL, and stops every process it started.
"""

from __future__ import annotations

import signal
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.processes import ProcessGroup, wait_for_log
from models import FINAL_STATES, Message
from worker import configuration, schema
from worker.runtime import get_runtime

ROUTES = [
    ("customer", "createCustomer"),
    ("customer", "updateCustomer"),
    ("order", "placeOrder"),
    ("billing", "chargeInvoice"),
]
# Short pool intervals so failed messages come back within the run.
DEMO_CONFIG = {
    "asynch.partlyFailedIntervalSec": "1",
    "asynch.partlyFailedRepeatTimeSec": "1",
}


def _counts(session: Session, source: str) -> dict[str, int]:
    rows = session.execute(
        select(Message.state, func.count())
        .where(Message.source_system == source)
        .group_by(Message.state)
    ).all()
    return {str(state): int(n) for state, n in rows}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_main_job(
    *, messages: int, workers: int, port: int, timeout: float, console: Console
) -> int:
    # A TERM stops the job like Ctrl-C does: the finally below stops every process started.
    signal.signal(signal.SIGTERM, _interrupt)
    runtime = get_runtime()
    url = runtime.settings.database_url
    console.rule("[bold]orderly main job")
    console.print(f"database {runtime.engine.url.render_as_string(hide_password=True)}")
    schema.upgrade(url)
    runtime.startup_check()
    for code, value in DEMO_CONFIG.items():
        configuration.set_value(runtime.engine, code, value)
    console.print(f"configuration for this run: {DEMO_CONFIG}")

    run_id = uuid.uuid4().hex[:8]
    source = f"demo-{run_id}"
    log_dir = Path(tempfile.mkdtemp(prefix=f"orderly-{run_id}-"))
    group = ProcessGroup.create(log_dir)
    try:
        api = group.start_api(port, extra_env={"ORDERLY_NODE_CODE": f"demo-api-{run_id}"})
        started = [
            group.start_worker(f"worker{i}", concurrency=2, node_code=f"demo-worker{i}-{run_id}")
            for i in range(workers)
        ]
        started.append(group.start_beat(extra_env={"ORDERLY_NODE_CODE": f"demo-beat-{run_id}"}))
        for w in started[:-1]:
            wait_for_log(w, "ready.", timeout=60)
        console.print(
            f"started api (pid {api.proc.pid}), {workers} workers and beat; logs in {log_dir}"
        )

        base = datetime.now(UTC)
        t0 = time.monotonic()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            sub = progress.add_task("submitted", total=messages)
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

            def post(i: int) -> int:
                service, operation = ROUTES[i % len(ROUTES)]
                body = {
                    "service": service,
                    "operation": operation,
                    "correlation_id": f"{run_id}-{i}",
                    "source_system": source,
                    "msg_timestamp": (base + timedelta(milliseconds=i)).isoformat(),
                    "payload": {"n": i, "customer": f"c{i % 97}"},
                    "object_id": f"c{i % 97}",
                    "entity_type": "customer",
                }
                code = client.post("/messages", json=body).status_code
                progress.advance(sub)
                return code

            with ThreadPoolExecutor(max_workers=8) as pool:
                codes = list(pool.map(post, range(messages)))
            client.close()
            accepted = sum(1 for c in codes if c == 201)
            submit_s = time.monotonic() - t0

            done = progress.add_task("final (OK/FAILED)", total=messages)
            deadline = time.monotonic() + timeout
            with Session(runtime.engine) as session:
                while True:
                    counts = _counts(session, source)
                    session.rollback()
                    final = sum(n for s, n in counts.items() if s in FINAL_STATES)
                    progress.update(done, completed=final)
                    if final >= accepted or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
        elapsed = time.monotonic() - t0
    finally:
        group.stop_all()

    table = Table(title=f"final states of run {run_id} (from PostgreSQL)")
    table.add_column("state")
    table.add_column("messages", justify="right")
    for state, n in sorted(counts.items()):
        table.add_row(state, str(n))
    console.print(table)
    console.print(
        f"{accepted} accepted of {messages} in {submit_s:.1f}s; all final after "
        f"{elapsed:.1f}s; every process stopped"
    )
    if final < accepted:
        console.print(f"[red]{accepted - final} messages not final within {timeout}s[/]")
        return 1
    return 0
