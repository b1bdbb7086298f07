"""Where a plain message's time goes: intake and processing in this one process, profiled.

    python -m benchmarks.profile [--quick] [--messages N] [--batch B] [--top K]

Submits N no-op messages (``bench.noop``) one call each (``Intake.submit``) and then B a call
(``submit_many``), and processes each set with the worker's own batches
(``orderly.worker.messages.batches.process_batch``, ``ORDERLY_CLAIM_BATCH`` a claim), all under
cProfile, with no broker and no other process: what is left is orderly's own work and its two
servers'. For each phase it prints the profile's top functions by own time, and PostgreSQL's
and Redis's own counters per message: commits (``pg_stat_database.xact_commit``), rows
inserted and updated and the WAL written (``pg_stat_wal.wal_bytes``), Redis commands
(``total_commands_processed``). The last line is one JSON object with those figures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.common import prepare, reset_messages, use_bench_services

use_bench_services()  # before the app modules read their settings

import redis  # noqa: E402
from sqlalchemy import text  # noqa: E402

from benchmarks.peers import body  # noqa: E402
from orderly.worker.messages.batches import process_batch  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402


def counters(r: redis.Redis) -> dict[str, int]:
    """The servers' own counters now (PostgreSQL's after this process's pool is closed: a
    backend hands its statistics over when it ends)."""
    engine = get_runtime().engine
    engine.dispose()
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
    engine.dispose()
    time.sleep(1.1)  # the statistics collector's own delay (PGSTAT_MIN_INTERVAL)
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT d.xact_commit, t.n_tup_ins, t.n_tup_upd, w.wal_bytes"
                "  FROM pg_stat_database d, pg_stat_user_tables t, pg_stat_wal w"
                " WHERE d.datname = current_database() AND t.relname = 'message'"
            )
        ).one()
    engine.dispose()
    return {
        "commits": int(row[0]),
        "inserted": int(row[1]),
        "updated": int(row[2]),
        "wal_bytes": int(row[3]),
        "redis_cmds": int(r.info("stats")["total_commands_processed"]),
    }


def phase(
    name: str, n: int, r: redis.Redis, work: Callable[[], object], top: int
) -> dict[str, Any]:
    before = counters(r)
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    profile.enable()
    work()
    profile.disable()
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    after = counters(r)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    print(f"--- {name}: {n} messages in {seconds:.2f} s", flush=True)
    print("\n".join(lines[-(top + 1) :]), flush=True)
    figures: dict[str, Any] = {
        "per_s": round(n / seconds, 1),
        "process_cpu_ms_per_msg": round(cpu * 1000 / n, 3),
    }
    for key in ("commits", "inserted", "updated", "wal_bytes", "redis_cmds"):
        # The counters' own reads (one commit, one INFO) are not the phase's.
        own = 2 if key in ("commits", "redis_cmds") else 0
        figures[f"{key}_per_msg"] = round((after[key] - before[key] - own) / n, 3)
    print(figures, flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under a minute")
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    n = args.messages or (2000 if args.quick else 10000)
    r, group = prepare()
    runtime = get_runtime()
    intake = runtime.intake(lambda msg_id: None, lambda: None)
    processor = runtime.processor
    size = runtime.settings.claim_batch

    def drain() -> None:
        while process_batch(processor, size, lambda msg_id: None)[1]:
            pass

    results: dict[str, Any] = {"messages": n, "claim_batch": size, "submit_many": args.batch}
    try:
        reset_messages(r)
        run = uuid.uuid4().hex[:6]
        results["intake_1by1"] = phase(
            "intake, one a call", n, r, lambda: [intake.submit(body(run, i)) for i in range(n)],
            args.top,
        )  # fmt: skip
        results["processing"] = phase("processing", n, r, drain, args.top)
        reset_messages(r)
        run = uuid.uuid4().hex[:6]

        def many() -> None:
            for start in range(0, n, args.batch):
                end = min(start + args.batch, n)
                intake.submit_many([body(run, i) for i in range(start, end)])

        results["intake_batch"] = phase(f"intake, {args.batch} a call", n, r, many, args.top)
    finally:
        group.stop_all()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
