"""The main job: a real end-to-end run on the local services.

Migrates, starts the API, workers and beat as processes, submits messages across several
services whose handlers fail now and then, shows progress, prints the final state counts
from PostgreSQL; then runs a conversation workload through a client sink that fails now and
then, answers 202 and ACKs (or not), and checks that every conversation arrived in order.
Stops every process it started.
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
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from orderly.api.metrics import runtime_figures
from orderly.api.status import print_status
from orderly.models import FINAL_STATES, Message
from orderly.worker import configuration, keys
from orderly.worker.db import schema
from orderly.worker.runtime import get_runtime
from tooling.apikeys import bearer
from tooling.processes import ProcessGroup, wait_for_log
from tooling.sink import Sink
from tooling.workload import check, generate, submit

ROUTES = [
    ("customer", "createCustomer"),
    ("customer", "updateCustomer"),
    ("order", "placeOrder"),
    ("billing", "chargeInvoice"),
]
# Conversation timings for a demo: an ACK that never comes, and an AWAITED group, are taken
# up again within seconds rather than the production defaults.
DEMO_ENV = {
    "ORDERLY_HANDLER_MODULES": "tooling.handlers",
    "AURA_QUEUE_MANAGER_SENT_MESSAGE_TTL": "1000",
    "AURA_QUEUE_MANAGER_AWAITED_TIME_WHEN_RETRIES_END": "1000",
    "AURA_QUEUE_MANAGER_AWAITED_MESSAGES_INTERVAL": "2000",
    "AURA_QUEUE_MANAGER_MESSAGE_TTL": "60000",
    "AURA_QUEUE_MANAGER_INTERVAL": "50",
}
DEMO_CHANNEL = {"delivery_delay_ms": 50, "multiplier": 2.0, "attempts": 3, "timeout_ms": 1000}
# The client's behaviour: 10% recoverable and 2% non-recoverable failures, 20% answered 202
# with a quarter of those never ACKed.
DEMO_SINK = {
    "p_recoverable": 0.10,
    "p_non_recoverable": 0.02,
    "p_async": 0.20,
    "p_never_ack": 0.25,
    "ack_delay_ms": [5, 100],
}
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


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_main_job(
    *,
    messages: int,
    workers: int,
    port: int,
    timeout: float,
    console: Console,
    conversations: int = 200,
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
    # The report at the end covers this run: every row received from now on.
    run_started = datetime.now(UTC) - timedelta(seconds=1)
    source = f"demo-{run_id}"
    log_dir = Path(tempfile.mkdtemp(prefix=f"orderly-{run_id}-"))
    group = ProcessGroup.create(log_dir, env=DEMO_ENV)
    sink = Sink().start()  # configured once the API is up
    messages_ok = conversation_ok = False
    # The run's own API key, with every scope; revoked when the run ends.
    key_name = f"demo-{run_id}"
    auth = bearer(runtime.engine, key_name)
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
        with _progress(console) as progress:
            sub = progress.add_task("submitted", total=messages)
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=auth)

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
        table = Table(title=f"final states of run {run_id} (from PostgreSQL)")
        table.add_column("state")
        table.add_column("messages", justify="right")
        for state, n in sorted(counts.items()):
            table.add_row(state, str(n))
        console.print(table)
        console.print(
            f"{accepted} accepted of {messages} in {submit_s:.1f}s; all final after {elapsed:.1f}s"
        )
        messages_ok = final >= accepted
        if not messages_ok:
            console.print(f"[red]{accepted - final} messages not final within {timeout}s[/]")
        conversation_ok = _conversation_workload(
            port, auth, sink, run_id, conversations, timeout, console
        )
        _operator_view(port, auth, console)
    finally:
        group.stop_all()
        sink.stop()
        keys.revoke_key(runtime.engine, key_name)
    console.print("every process stopped")
    report_ok = _report(run_started, console)
    return 0 if messages_ok and conversation_ok and report_ok else 1


def _report(since: datetime, console: Console) -> bool:
    """The Spark report of this run's rows, and where its HTML is."""
    from orderly.reports.job import ReportOptions, run_report
    from orderly.reports.source import ReportError

    console.rule("[bold]report of this run (Spark over JDBC)")
    try:
        result = run_report(ReportOptions(since=since, until=datetime.now(UTC)))
    except ReportError as exc:
        console.print(f"[red]the report failed: {exc}[/]")
        return False
    table = Table(title=f"report {result.data.run_id}")
    table.add_column("aggregate")
    table.add_column("rows", justify="right")
    for aggregate in result.data.aggregates:
        table.add_row(aggregate.title, str(len(aggregate.rows)))
    console.print(table)
    read = ", ".join(f"{t} {n:,}" for t, n in result.data.rows_read.items() if n)
    console.print(
        f"rows read into memory (reads taken more than once): {read}; "
        f"{result.total_s:.1f}s with Spark's start"
    )
    console.print(f"Parquet and CSV: {result.folder}")
    console.print(f"[bold]HTML report: {result.html.resolve()}[/]")
    return True


def _operator_view(port: int, auth: dict[str, str], console: Console) -> None:
    """What an operator sees of the run: ``orderly status`` and the metrics endpoint."""
    console.rule("[bold]operator's view: orderly status")
    # Workers report done ids; the timeout monitor (beat, every second) counts them.
    time.sleep(2 * get_runtime().settings.track_monitor_interval_ms / 1000)
    figures = runtime_figures()
    print_status(figures, console)
    for source, reason in figures.errors.items():
        console.print(f"[red]{source.value} could not be read: {reason}[/]")
    scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30, headers=auth)
    samples = [line for line in scraped.text.splitlines() if line and not line.startswith("#")]
    console.print(
        f"GET /metrics: HTTP {scraped.status_code}, {len(samples)} samples "
        f"(Prometheus text format, for a scraper)"
    )


def _conversation_workload(
    port: int,
    auth: dict[str, str],
    sink: Sink,
    run_id: str,
    conversations: int,
    timeout: float,
    console: Console,
) -> bool:
    """Conversations through the sink; True when every one arrived in order, nothing lost."""
    runtime = get_runtime()
    api = f"http://127.0.0.1:{port}"
    origin = f"demo-chat-{run_id}"
    client = httpx.Client(base_url=api, timeout=30, headers=auth)
    client.put(f"/channels/{origin}", json={"url": sink.url, **DEMO_CHANNEL}).raise_for_status()
    sink.configure(**{**DEMO_SINK, "seed": int(run_id, 16), "orderly_url": api})
    workload = generate(seed=int(run_id, 16), conversations=conversations, prefix=f"{run_id}-")
    console.rule("[bold]conversations")
    console.print(
        f"{conversations} conversations, {workload.requests} requests, {workload.responses} "
        f"responses, submitted shuffled; the client fails 10% recoverably and 2% for good, "
        f"answers 202 to 20% (a quarter never ACKed); sink at {sink.url}"
    )
    t0 = time.monotonic()

    def open_responses() -> int:
        with runtime.engine.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM message WHERE service_name = 'conversation' "
                        "AND operation_name = 'response' AND process_id LIKE :p "
                        "AND state NOT IN ('OK', 'CANCEL', 'FAILED')"
                    ),
                    {"p": f"{run_id}-%"},
                ).scalar_one()
            )

    with _progress(console) as progress:
        sent = progress.add_task("requests and responses submitted", total=len(workload.events))
        submission = submit(workload, client, origin, lambda _: progress.advance(sent))
        done = progress.add_task("responses delivered or cancelled", total=workload.responses)
        deadline = time.monotonic() + timeout
        while True:
            remaining = open_responses()
            progress.update(done, completed=workload.responses - remaining)
            if remaining == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    client.close()
    elapsed = time.monotonic() - t0
    with runtime.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT correlation_id, state, failed_error_code, late_ms FROM message "
                "WHERE service_name = 'conversation' AND process_id LIKE :p"
            ),
            {"p": f"{run_id}-%"},
        ).all()
    states = {r.correlation_id: r.state for r in rows}
    awaited = sum(1 for r in rows if r.failed_error_code == "E_RETRIES_SPENT")
    arrivals = sink.arrivals()
    verdict = check(
        workload,
        arrivals,
        states,
        submission=submission,
        message_ttl_ms=float(DEMO_ENV["AURA_QUEUE_MANAGER_MESSAGE_TTL"]),
        marked_late=[r.correlation_id for r in rows if r.late_ms is not None],
    )

    table = Table(title=f"conversations of run {run_id}")
    table.add_column("")
    table.add_column("count", justify="right")
    for label, value in (
        ("responses delivered, in order", verdict.delivered),
        ("deliveries retried (recoverable failures)", verdict.retried),
        ("responses that went AWAITED", awaited),
        ("groups cancelled (non-recoverable)", verdict.cancelled_groups),
        ("responses cancelled with their group", verdict.cancelled_responses),
        ("answered 202, ACKed", sum(1 for a in arrivals if a["ack_status"] == 200)),
        (
            "answered 202, never ACKed",
            sum(1 for a in arrivals if a["status"] == 202 and a["ack_status"] is None),
        ),
        (
            "late: responses orderly marked late (request past MESSAGE_TTL)",
            len(verdict.marked_late),
        ),
        ("late: requests answered past MESSAGE_TTL, held to their own order", len(verdict.late)),
        ("responses missing", len(verdict.missing)),
        ("delivered after their group was cancelled", len(verdict.after_cancel)),
        ("PostgreSQL disagreeing with the client", len(verdict.mismatches)),
        ("order violations", verdict.order_violations),
    ):
        table.add_row(label, str(value))
    console.print(table)
    console.print(
        f"conversations done in {elapsed:.1f}s; submitted in {submission.duration_s:.1f}s "
        f"({len(workload.events) / max(submission.duration_s, 1e-9):.0f} events/s)"
    )
    if verdict.ok:
        console.print(
            f"[green]verified: {verdict.delivered} responses delivered in conversation order "
            f"({len(verdict.marked_late)} of them late, in order within their request), "
            f"{verdict.retried} retried, {verdict.cancelled_responses} cancelled with their "
            f"group, 0 missing, 0 order violations, PostgreSQL agreeing with the client[/]"
        )
    else:
        console.print(
            f"[red]conversation check failed: {verdict.violations[:5]} "
            f"{verdict.missing[:5]} {verdict.mismatches[:5]}[/]"
        )
    return verdict.ok
