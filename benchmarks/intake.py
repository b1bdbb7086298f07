"""Intake and processing throughput, beside raw Celery in the same run.

    python -m benchmarks.intake [--quick] [--messages N] [--workers W] [--concurrency C]

Measures messages accepted/s through the HTTP API and through the Python API, processed/s
end to end with a no-op handler, and raw Celery no-op tasks/s with the same workers on the
same broker. Processing and the baseline are timed the same way: the queue is filled first,
then the workers start, and the clock runs from the first message taken to the last one done.
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

from benchmarks.common import prepare, reset_messages, use_bench_services, worker_argv

use_bench_services()  # before the app modules read their settings

import httpx  # noqa: E402
import redis  # noqa: E402
from sqlalchemy import text  # noqa: E402

from tooling.apikeys import bearer  # noqa: E402
from tooling.processes import ProcessGroup  # noqa: E402
from worker.celery import PROCESS_QUEUE, app, enqueue_processing  # noqa: E402
from worker.runtime import get_runtime  # noqa: E402

BASE_TS = datetime(2026, 1, 1, tzinfo=UTC)


def body(run: str, i: int) -> dict[str, object]:
    return {
        "service": "bench",
        "operation": "noop",
        "correlation_id": f"{run}-{i}",
        "source_system": "bench",
        "msg_timestamp": (BASE_TS + timedelta(microseconds=i)).isoformat(),
        "payload": {"i": i},
    }


def measure_http(group: ProcessGroup, n: int, threads: int) -> float:
    port = 18700 + os.getpid() % 1000
    api = group.start_api(port, name="bench-api", extra_env={"ORDERLY_NODE_CODE": "bench-api"})
    run = uuid.uuid4().hex[:6]
    local = threading.local()
    auth = bearer(get_runtime().engine)

    def post(i: int) -> None:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=auth)
        answer = client.post("/messages", json=body(run, i))
        if answer.status_code != 201:
            raise RuntimeError(answer.text)

    for i in range(50):  # warm-up
        post(-1 - i)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(post, range(n)))
    elapsed = time.perf_counter() - t0
    group.stop(api)
    return n / elapsed


def measure_python(n: int) -> float:
    intake = get_runtime().intake(enqueue_processing)
    run = uuid.uuid4().hex[:6]
    t0 = time.perf_counter()
    for i in range(n):
        intake.submit(body(run, i))
    return n / (time.perf_counter() - t0)


def drain_rate(
    group: ProcessGroup,
    r: redis.Redis,
    n: int,
    args: argparse.Namespace,
    tag: str,
) -> float:
    """Start the workers on a full queue; tasks/s from the first taken to the last done."""
    assert r.llen(PROCESS_QUEUE) == n, (r.llen(PROCESS_QUEUE), n)
    workers = [
        group.start(
            f"{tag}-w{i}",
            worker_argv(f"{tag}{i}", PROCESS_QUEUE, args.pool, args.concurrency),
            {"ORDERLY_NODE_CODE": f"bench-{tag}{i}"},
        )
        for i in range(args.workers)
    ]
    deadline = time.monotonic() + 600
    while r.llen(PROCESS_QUEUE) == n:
        if time.monotonic() > deadline or not all(w.alive() for w in workers):
            raise RuntimeError(f"workers did not start; see {group.log_dir}")
        time.sleep(0.002)
    t0 = time.perf_counter()
    while r.llen(PROCESS_QUEUE) > 0 or r.hlen("unacked") > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("queue did not drain")
        time.sleep(0.002)
    elapsed = time.perf_counter() - t0
    for w in workers:
        group.stop(w)
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under 60 s")
    parser.add_argument("--messages", type=int, default=None)
    # Celery's own default on this machine: one worker, prefork, concurrency = CPU count.
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rounds", type=int, default=None, help="orderly/baseline pairs")
    parser.add_argument("--pool", default="prefork")
    parser.add_argument("--http-threads", type=int, default=4)
    args = parser.parse_args()
    n = args.messages or (1500 if args.quick else 20000)
    args.rounds = args.rounds or (2 if args.quick else 3)

    runtime = get_runtime()
    r, group = prepare()
    python_runs: list[float] = []
    processed_runs: list[float] = []
    celery_runs: list[float] = []
    layout = f"{args.workers} worker(s) x {args.concurrency} {args.pool}"
    try:
        reset_messages(r)
        api_per_s = measure_http(group, n, args.http_threads)
        print(
            f"HTTP API intake:    {api_per_s:8.0f} msg/s ({n} messages, "
            f"{args.http_threads} client threads, 1 API process)",
            flush=True,
        )
        # Rounds interleave orderly and the baseline, so drift on the machine hits both.
        for round_no in range(1, args.rounds + 1):
            reset_messages(r)
            python_runs.append(measure_python(n))
            processed_runs.append(drain_rate(group, r, n, args, "orderly"))
            with runtime.engine.connect() as conn:
                ok = conn.execute(
                    text("SELECT count(*) FROM message WHERE state = 'OK'")
                ).scalar_one()
            if ok != n:
                raise RuntimeError(f"only {ok} of {n} messages are OK")
            reset_messages(r)
            for i in range(n):
                app.send_task("orderly.process.bench_noop", args=(i,))
            celery_runs.append(drain_rate(group, r, n, args, "celery"))
            print(
                f"round {round_no}: Python API intake {python_runs[-1]:.0f} msg/s, "
                f"processed {processed_runs[-1]:.0f} msg/s, raw Celery no-op "
                f"{celery_runs[-1]:.0f} tasks/s ({layout})",
                flush=True,
            )
    finally:
        group.stop_all()
        r.close()

    python_per_s = statistics.median(python_runs)
    processed_per_s = statistics.median(processed_runs)
    celery_noop_per_s = statistics.median(celery_runs)
    print(
        f"medians of {args.rounds} rounds: processed {processed_per_s:.0f}/s, "
        f"raw Celery {celery_noop_per_s:.0f}/s",
        flush=True,
    )
    figures = {
        "messages": n,
        "rounds": args.rounds,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "pool": args.pool,
        "api_per_s": round(api_per_s, 1),
        "python_per_s": round(python_per_s, 1),
        "processed_per_s": round(processed_per_s, 1),
        "celery_noop_per_s": round(celery_noop_per_s, 1),
        "ratio": round(processed_per_s / celery_noop_per_s, 3),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
