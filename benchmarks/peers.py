"""orderly beside its peers, in one run, with the same two worker processes for every system.

    python -m benchmarks.peers [--quick] [--messages N] [--keys K] [--per-key P]

Scenarios (each system's messages/s, all-in CPU ms, PostgreSQL commits and Redis commands
per message):

- ``plain_queued`` / ``plain_submitting``: no-op tasks, all queued before the workers start
  (timed from the first taken to the last done) or submitted while they run (timed from the
  first submitted). Plain Celery (benchmarks/peer_apps/celery_app.py), dramatiq, procrastinate
  and orderly (a durable message row per message, ``bench.noop``): ``orderly`` submits 500 a
  call (``Intake.submit_many``, as procrastinate's ``batch_defer``), ``orderly_1by1`` one a
  call (as Celery sends).
- ``ordered_queued`` / ``ordered_submitting``: K ordering keys x P messages, each key's in
  order: orderly's guaranteed order (``funnel_value``) and procrastinate's ``lock``.
- ``http_1`` / ``http_4``: from 1 and 4 client threads, beside a bare ASGI app on the same
  uvicorn (benchmarks/peer_apps/asgi_app.py), both with API_PROCESSES processes:
  ``POST /messages``, ``POST /messages:batch``
  (1,000 a request), conversation turns (a request and its response) and published events
  (a room with one PULL subscription), each per message.
- ``batch``: batch intake, through the Python call (``Intake.submit_many``, 1,000 a call) and
  the API from 1 and 4 clients.

All-in CPU is every process the scenario keeps busy: the workers with their children, the
producer (this process), the API, redis-server and the PostgreSQL processes. The Redis and
PostgreSQL figures are the servers' own counters (``total_commands_processed``,
``pg_stat_database.xact_commit`` of the bench databases) less what the benchmark itself sent
(its Redis polls, and the peers' one INCR or RPUSH per message that reports it done). Run it on an
idle machine: the counters are the servers', so other clients would count too.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import prepare, reset_messages, use_bench_services, worker_argv
from benchmarks.peer_apps import DONE_KEY, ORDER_KEY, PEERS_DSN, REDIS_URL

use_bench_services()  # before the app modules read their settings

import httpx  # noqa: E402
import redis  # noqa: E402
from sqlalchemy import create_engine, make_url, text  # noqa: E402

from benchmarks import funnel  # noqa: E402
from orderly.worker.celery import PROCESS_QUEUE, enqueue_processing, wake_processing  # noqa: E402
from orderly.worker.messages.pipeline import Pipeline  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from tooling.apikeys import bearer  # noqa: E402
from tooling.processes import ROOT, Managed, ProcessGroup, free_port, wait_http  # noqa: E402

BIN = Path(sys.executable).parent
BASE_TS = datetime(2026, 1, 1, tzinfo=UTC)
TICK = os.sysconf("SC_CLK_TCK")
PLAIN = ("celery", "dramatiq", "procrastinate", "orderly_1by1", "orderly_pipelined", "orderly")
PEERS = ("celery", "dramatiq", "procrastinate")
# procrastinate's database, reached through psycopg2 by the benchmark itself
PEERS_URL = make_url(PEERS_DSN).set(drivername="postgresql+psycopg2")


# --- what a scenario cost --------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return found
    for kid in kids:
        found += _children(int(kid))
    return found


def _by_name(*names: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in names:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


@dataclass
class Cost:
    seconds: float
    cpu_s: float
    pg_commits: int
    redis_cmds: int
    producer_cpu_s: float = 0.0  # this process's: the producer (and the benchmark's polls)


class Meter:
    """CPU of the watched processes and the servers, commits and commands, start to stop."""

    def __init__(self, r: redis.Redis, pg_admin: Any, engines: list[Any]) -> None:
        self.r = r
        self.pg = pg_admin
        self.databases = [
            make_url(get_runtime().settings.database_url).database,
            PEERS_URL.database,
        ]
        # This process's own pools: closed before the commits are read, since a backend
        # hands its statistics to pg_stat_database when it ends (or a while after it idles).
        self.engines = engines
        # Commands this benchmark sent while metering. Its polls of PostgreSQL end in a
        # rollback (read only): xact_commit does not count them.
        self.own_redis = 0

    def _commits(self) -> int:
        with self.pg.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT COALESCE(sum(xact_commit), 0) FROM pg_stat_database"
                        " WHERE datname = ANY(:names)"
                    ),
                    {"names": self.databases},
                ).scalar_one()
            )

    def _settled_commits(self) -> int:
        """The commits once the backends of stopped processes have handed theirs over (a
        backend reports when it ends, a moment after its process): read until two reads half
        a second apart agree, at most a few seconds."""
        last = self._commits()
        for _ in range(6):
            time.sleep(0.5)
            now = self._commits()  # read in another database: not counted
            if now == last:
                break
            last = now
        return last

    def _cpu(self, roots: Iterable[int]) -> dict[int, int]:
        pids = {p for root in roots for p in _children(root)}
        pids |= set(_by_name("redis-server", "postgres"))
        return {p: _ticks(p) for p in pids}

    def start(self, roots: Iterable[int] = ()) -> None:
        self.own_redis = 0
        self.self1 = 0.0
        self.cpu0 = self._cpu(roots)
        self.self0 = time.process_time()
        self.commits0 = self._commits()
        self.cmds0 = int(self.r.info("stats")["total_commands_processed"])

    def rebase(self, roots: Iterable[int]) -> None:
        """Processes started since ``start``: counted from now on."""
        for pid, ticks in self._cpu(roots).items():
            self.cpu0.setdefault(pid, ticks)

    def sample(self, roots: Iterable[int]) -> dict[int, int]:
        """The watched processes' CPU now (before some of them stop), this one's with it."""
        self.self1 = time.process_time()
        return self._cpu(roots)

    def stop(self, cpu_then: dict[int, int], seconds: float) -> Cost:
        cmds = int(self.r.info("stats")["total_commands_processed"]) - self.cmds0 - 1
        for engine in self.engines:
            engine.dispose()
        commits = self._settled_commits() - self.commits0
        ticks = sum(t - self.cpu0.get(p, 0) for p, t in cpu_then.items())
        producer = self.self1 - self.self0
        return Cost(seconds, ticks / TICK + producer, commits, cmds - self.own_redis, producer)


def figures(n: int, cost: Cost, *, extra_redis: int = 0) -> dict[str, float]:
    """Per message; ``extra_redis``: commands per message the benchmark's own reporting
    added inside the workers (an INCR or RPUSH)."""
    return {
        "per_s": round(n / cost.seconds, 1),
        "cpu_ms_per_msg": round(cost.cpu_s * 1000 / n, 3),
        "pg_commits_per_msg": round(cost.pg_commits / n, 3),
        "redis_cmds_per_msg": round(cost.redis_cmds / n - extra_redis, 3),
        "producer_cpu_ms_per_msg": round(cost.producer_cpu_s * 1000 / n, 3),
    }


# --- the systems ------------------------------------------------------------------------------


def _wait(system: System, target: int, workers: list[Managed]) -> None:
    """Until ``target`` tasks are done, checked every 10 ms with a check that costs the same
    however many are left: a Redis GET, or whether an index of unfinished work is empty."""
    deadline = time.monotonic() + 900
    while True:
        left = system.remaining(target)
        if left <= 0:
            return
        if time.monotonic() > deadline or not all(w.alive() for w in workers):
            raise RuntimeError(f"{left} of {target} left; see {system.group.log_dir}")
        time.sleep(0.01)


class System:
    """A system's producer, workers and the count of what it finished."""

    name = ""
    extra_redis = 0  # the worker's own done report, per message

    def __init__(self, group: ProcessGroup, r: redis.Redis, meter: Meter) -> None:
        self.group = group
        self.r = r
        self.meter = meter

    def reset(self) -> None:
        raise NotImplementedError

    def submit(self, first: int, count: int) -> None:
        raise NotImplementedError

    def start_workers(self) -> list[Managed]:
        raise NotImplementedError

    def remaining(self, target: int) -> int:
        """Whether (or how many of) ``target`` tasks are not done yet: 0 when all are."""
        raise NotImplementedError

    def queued(self) -> int:
        """Tasks waiting in the broker (to see the workers start)."""
        raise NotImplementedError


class RedisCounted(System):
    extra_redis = 1

    def remaining(self, target: int) -> int:
        self.meter.own_redis += 1
        return target - int(self.r.get(DONE_KEY) or 0)


class PlainCelery(RedisCounted):
    name = "celery"
    pool = "solo"

    def reset(self) -> None:
        self.r.flushdb()

    def submit(self, first: int, count: int) -> None:
        from benchmarks.peer_apps import celery_app

        celery_app.send(first, count)

    def start_workers(self) -> list[Managed]:
        return [
            self.group.start(
                f"celery-{i}",
                [
                    str(BIN / "celery"),
                    "-A",
                    "benchmarks.peer_apps.celery_app",
                    "worker",
                    "-n",
                    f"peers{i}-{uuid.uuid4().hex[:4]}@%h",
                    "--pool",
                    self.pool,
                    "--concurrency",
                    "1",
                    "-Q",
                    "peers.celery",
                    "--without-mingle",
                    "--without-gossip",
                    "--without-heartbeat",
                    "--loglevel",
                    "WARNING",
                ],
            )
            for i in range(2)
        ]

    def queued(self) -> int:
        self.meter.own_redis += 1
        return int(self.r.llen("peers.celery"))


class Dramatiq(RedisCounted):
    name = "dramatiq"

    def reset(self) -> None:
        self.r.flushdb()

    def submit(self, first: int, count: int) -> None:
        from benchmarks.peer_apps import dramatiq_app

        dramatiq_app.send(first, count)

    def start_workers(self) -> list[Managed]:
        argv = [str(BIN / "dramatiq"), "benchmarks.peer_apps.dramatiq_app", "--processes", "2"]
        return [self.group.start("dramatiq", argv)]

    def queued(self) -> int:
        self.meter.own_redis += 1
        return int(self.r.llen("dramatiq:peers"))


# procrastinate's workers wait for a NOTIFY of a new job, else poll (every 5 s by default); a
# job behind a lock becomes fetchable when its predecessor ends, with no NOTIFY: with locks its
# workers poll this often instead (twice its rate, or more, in these runs).
LOCK_POLLING_S = 0.05


class Procrastinate(System):
    name = "procrastinate"

    def __init__(self, group: ProcessGroup, r: redis.Redis, meter: Meter) -> None:
        super().__init__(group, r, meter)
        self.polling_s: float | None = None  # None: procrastinate's default
        from benchmarks.peer_apps import procrastinate_app

        self.app = procrastinate_app.app
        self.tasks = procrastinate_app
        self.engine = create_engine(PEERS_URL)

    def reset(self) -> None:
        self.r.flushdb()
        with self.engine.begin() as conn:
            conn.execute(text("TRUNCATE procrastinate_jobs CASCADE"))

    def submit(self, first: int, count: int) -> None:
        with self.app.open():
            for start in range(first, first + count, 500):
                chunk = range(start, min(start + 500, first + count))
                jobs: list[dict[str, Any]] = [{"n": n} for n in chunk]
                self.tasks.noop.batch_defer(*jobs)

    def submit_ordered(self, keys: int, per_key: int) -> None:
        with self.app.open():
            for i in range(per_key):
                for k in range(keys):
                    self.tasks.ordered.configure(lock=f"k{k}").defer(key=f"k{k}", n=i)

    def start_workers(self) -> list[Managed]:
        app = "benchmarks.peer_apps.procrastinate_app.app"
        argv = [str(BIN / "procrastinate"), "--app", app, "--log-level", "warning",
                "worker", "--concurrency", "4", "-q", "peers"]  # fmt: skip
        if self.polling_s is not None:
            argv += ["--fetch-job-polling-interval", str(self.polling_s)]
        # Its command does not look in the working directory for the app: name it.
        env = {"PYTHONPATH": str(ROOT)}
        return [self.group.start(f"procrastinate-{i}", argv, env) for i in range(2)]

    def _count(self, where: str, *, exists: bool = False) -> int:
        """How many jobs match; with ``exists``, 1 when any does."""
        if exists:
            query = f"SELECT EXISTS (SELECT 1 FROM procrastinate_jobs WHERE {where})"
        else:
            query = f"SELECT count(*) FROM procrastinate_jobs WHERE {where}"
        with self.engine.connect() as conn:
            return int(conn.execute(text(query)).scalar_one())

    def remaining(self, target: int) -> int:
        # 1 while any job is left: the first entry of procrastinate_jobs_id_lock_idx_v1, not a
        # count (a count walks every entry, on the PostgreSQL procrastinate itself runs on)
        return self._count("status IN ('todo', 'doing')", exists=True)

    def queued(self) -> int:
        return self._count("status = 'todo'")


class Orderly(System):
    """orderly's producer submits in batches of 500 (``Intake.submit_many``), as
    procrastinate's defers them (``batch_defer``)."""

    name = "orderly"
    chunk = 500

    def __init__(self, group: ProcessGroup, r: redis.Redis, meter: Meter) -> None:
        super().__init__(group, r, meter)
        self.runtime = get_runtime()
        self.intake = self.runtime.intake(enqueue_processing, wake_processing)
        self.run = uuid.uuid4().hex[:6]

    def reset(self) -> None:
        reset_messages(self.r)
        self.run = uuid.uuid4().hex[:6]

    def submit(self, first: int, count: int) -> None:
        for start in range(first, first + count, self.chunk):
            end = min(start + self.chunk, first + count)
            self.intake.submit_many([body(self.run, i) for i in range(start, end)])

    def start_workers(self) -> list[Managed]:
        tag = uuid.uuid4().hex[:4]
        return [
            self.group.start(
                f"orderly-{i}",
                worker_argv(f"o{tag}{i}", PROCESS_QUEUE, "prefork", 1),
                {"ORDERLY_NODE_CODE": f"bench-o{i}"},
            )
            for i in range(2)
        ]

    def remaining(self, target: int) -> int:
        """1 while a message is not final: the first entry of ix_message_pending."""
        with self.runtime.engine.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT EXISTS (SELECT 1 FROM message"
                        " WHERE state NOT IN ('OK', 'FAILED', 'CANCEL'))"
                    )
                ).scalar_one()
            )

    def queued(self) -> int:
        """Tasks in the broker: the wake-up (or two, should submitting outlast its mark)."""
        self.meter.own_redis += 1
        return int(self.r.llen(PROCESS_QUEUE))


class OrderlyOneByOne(Orderly):
    """orderly's producer submitting one message per call (``Intake.submit``), as plain
    Celery's sends one task per call."""

    name = "orderly_1by1"

    def submit(self, first: int, count: int) -> None:
        for i in range(first, first + count):
            self.intake.submit(body(self.run, i))


class OrderlyPipelined(Orderly):
    """orderly's producer handing over one message per call without waiting for its commit
    (``Pipeline.submit``: the calls made meanwhile share commits), as Celery's and dramatiq's
    sends return once their broker has the task; each message is answered after its commit,
    and every one is before the producer is done."""

    name = "orderly_pipelined"

    def __init__(self, group: ProcessGroup, r: redis.Redis, meter: Meter) -> None:
        super().__init__(group, r, meter)
        self.grouped = self.runtime.intake(enqueue_processing, wake_processing, grouped=True)

    def submit(self, first: int, count: int) -> None:
        with Pipeline(self.grouped) as pipeline:
            futures = [pipeline.submit(body(self.run, i)) for i in range(first, first + count)]
        for future in futures:
            future.result()  # each stored (a refusal raises here)


def body(run: str, i: int) -> dict[str, object]:
    return {
        "service": "bench",
        "operation": "noop",
        "correlation_id": f"{run}-{i}",
        "source_system": "bench",
        "msg_timestamp": (BASE_TS + timedelta(microseconds=i)).isoformat(),
        "payload": {"i": i},
    }


# --- scenarios --------------------------------------------------------------------------------


def _roots(workers: list[Managed]) -> list[int]:
    return [w.proc.pid for w in workers]


def queued_first(system: System, n: int, submit: Callable[[], object] | None = None) -> Cost:
    """Everything queued, then the workers: timed from the first task taken to the last done."""
    system.reset()
    meter = system.meter
    meter.start()
    (submit or (lambda: system.submit(0, n)))()
    queued = system.queued()
    workers = system.start_workers()
    deadline = time.monotonic() + 300
    while system.queued() >= queued:
        if time.monotonic() > deadline or not all(w.alive() for w in workers):
            raise RuntimeError(f"{system.name} workers did not start; see {system.group.log_dir}")
        time.sleep(0.002)
    t0 = time.perf_counter()
    meter.rebase(_roots(workers))  # their start-up is not what is measured
    _wait(system, n, workers)
    seconds = time.perf_counter() - t0
    cpu = meter.sample(_roots(workers))
    for w in workers:
        system.group.stop(w)
    return meter.stop(cpu, seconds)


def while_submitting(system: System, n: int, submit: Callable[[], object] | None = None) -> Cost:
    """Workers running and idle, then submitted: timed from the first submit to the last done.
    A few warm-up tasks first show the workers consume (their start-up is not measured)."""
    system.reset()
    workers = system.start_workers()
    warm = 4
    system.submit(-warm, warm)
    _wait(system, warm, workers)
    meter = system.meter
    meter.start(_roots(workers))
    t0 = time.perf_counter()
    (submit or (lambda: system.submit(0, n)))()
    _wait(system, warm + n, workers)
    seconds = time.perf_counter() - t0
    cpu = meter.sample(_roots(workers))
    for w in workers:
        system.group.stop(w)
    return meter.stop(cpu, seconds)


def plain_celery_rate(group: ProcessGroup, n: int) -> float:
    """Plain Celery no-op tasks/s with two worker processes, queued first: the baseline the
    other benchmarks set beside orderly."""
    r = redis.Redis.from_url(REDIS_URL)
    pg_admin = create_engine(PEERS_URL.set(database="postgres"))
    try:
        return n / queued_first(PlainCelery(group, r, Meter(r, pg_admin, [])), n).seconds
    finally:
        pg_admin.dispose()
        r.close()


# What one HTTP request of each intake carries, and how many messages that is.
HTTP_KINDS = ("messages", "batch", "conversation", "publish")
# uvicorn processes of orderly's API and of the bare ASGI app alike (one per core).
API_PROCESSES = 2
BATCH_SIZE = 1000


def _http_setup(client: httpx.Client, kind: str, run: str) -> None:
    """What the intake needs first: a channel for the conversations' origin, a room of the run
    with a PULL subscription for the events (each event then has a delivery, as in use)."""
    if kind == "conversation":
        channel = {"url": "http://127.0.0.1:9/", "delivery_delay_ms": 1000, "attempts": 1}
        client.put("/channels/bench", json=channel).raise_for_status()
    elif kind == "publish":
        client.post("/rooms", json={"name": f"bench-{run}"}).raise_for_status()
        sub = {"name": "pull", "kind": "PULL"}
        client.post(f"/rooms/bench-{run}/subscriptions", json=sub).raise_for_status()


def _http_unit(client: httpx.Client, kind: str, run: str, i: int) -> None:
    """The i-th unit of ``kind``: one message, a batch of BATCH_SIZE, a conversation turn (a
    request and its response: two messages) or one published event."""
    if kind == "messages":
        answers = [client.post("/messages", json=body(run, i))]
    elif kind == "batch":
        batch = [body(run, i * BATCH_SIZE + j) for j in range(BATCH_SIZE)]
        answers = [client.post("/messages:batch", json={"messages": batch})]
    elif kind == "conversation":
        conversation = f"/conversations/{run}-c{i % 64}"
        request = {"request_id": f"{run}-r{i}", "origin": "bench"}
        response = {"request_id": f"{run}-r{i}", "response_id": f"{run}-s{i}", "payload": {"i": i}}
        answers = [client.post(f"{conversation}/requests", json=request)]
        answers.append(client.post(f"{conversation}/responses", json=response))
    else:
        event = {"payload": {"i": i}, "routing_key": "bench.event"}
        answers = [client.post(f"/rooms/bench-{run}/events", json=event)]
    for answer in answers:
        if answer.status_code != 201:
            raise RuntimeError(f"{kind}: {answer.status_code} {answer.text[:300]}")


def http_per_unit(kind: str) -> int:
    return {"batch": BATCH_SIZE, "conversation": 2}.get(kind, 1)


def http_intake(
    group: ProcessGroup, meter: Meter, units: int, threads: int, kind: str = "messages"
) -> Cost:
    """``units`` of ``kind`` POSTed by ``threads`` clients to orderly's API, or (``asgi``)
    single messages to the bare ASGI app; timed from the first to the last answer."""
    port = free_port()
    if kind != "asgi":
        api = group.start_api(port, name=f"api-{kind}-{threads}",
                              extra_env={"ORDERLY_NODE_CODE": "b-api"},
                              workers=API_PROCESSES)  # fmt: skip
        headers = bearer(get_runtime().engine)
    else:
        argv = [str(BIN / "uvicorn"), "benchmarks.peer_apps.asgi_app:app", "--port", str(port),
                "--log-level", "warning", "--no-access-log",
                "--workers", str(API_PROCESSES)]  # fmt: skip
        api = group.start(f"asgi-{threads}", argv)
        headers = {}
    wait_http(f"http://127.0.0.1:{port}/health" if kind != "asgi" else f"http://127.0.0.1:{port}/",
              api, 60)  # fmt: skip
    run = uuid.uuid4().hex[:6]
    local = threading.local()
    unit_kind = "messages" if kind == "asgi" else kind

    def client() -> httpx.Client:
        found = getattr(local, "client", None)
        if found is None:
            found = local.client = httpx.Client(
                base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=120
            )
        return found

    def post(i: int) -> None:
        _http_unit(client(), unit_kind, run, i)

    if kind != "asgi":
        _http_setup(client(), kind, run)
    for i in range(1 if kind == "batch" else 20):  # warm-up
        post(-1 - i)
    meter.start([api.proc.pid])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(post, range(units)))
    seconds = time.perf_counter() - t0
    cpu = meter.sample([api.proc.pid])
    group.stop(api)
    return meter.stop(cpu, seconds)


def python_batch_intake(system: Orderly, n: int) -> Cost:
    """``Intake.submit_many`` in this process, BATCH_SIZE messages a call."""
    system.reset()
    meter = system.meter
    meter.start()
    t0 = time.perf_counter()
    for start in range(0, n, BATCH_SIZE):
        end = min(start + BATCH_SIZE, n)
        system.intake.submit_many([body(system.run, i) for i in range(start, end)])
    seconds = time.perf_counter() - t0
    return meter.stop(meter.sample([]), seconds)


def order_violations_procrastinate(r: redis.Redis, keys: int, per_key: int) -> int:
    bad = 0
    for k in range(keys):
        seen = [int(v) for v in r.lrange(ORDER_KEY + f"k{k}", 0, -1)]
        bad += sum(1 for a, b in itertools.pairwise(seen) if b < a)
        bad += per_key - len(seen)
    return bad


# --- the run -----------------------------------------------------------------------------------


def setup_peers_db() -> None:
    admin = create_engine(PEERS_URL.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{PEERS_URL.database}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{PEERS_URL.database}"'))
    admin.dispose()
    subprocess.run(
        [str(BIN / "procrastinate"), "--app", "benchmarks.peer_apps.procrastinate_app.app",
         "schema", "--apply"],
        check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under 2 minutes")
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--keys", type=int, default=None)
    parser.add_argument("--per-key", type=int, default=None)
    parser.add_argument("--posts", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="messages of batch intake")
    parser.add_argument(
        "--alone",
        action="store_true",
        help="without the front door, light-load and conversation benchmarks after it",
    )
    args = parser.parse_args()
    n = args.messages or (600 if args.quick else 20000)
    # Not 1,000 keys: procrastinate's lock check grows with the queue's depth (1,000 x 20
    # queued first: 1,605 jobs done in five minutes), so a full run would take hours.
    keys = args.keys or (30 if args.quick else 200)
    per_key = args.per_key or (10 if args.quick else 20)
    posts = args.posts or (300 if args.quick else 5000)
    batch_n = args.batch or (5 * BATCH_SIZE if args.quick else 20 * BATCH_SIZE)

    runtime = get_runtime()
    orderly_redis, group = prepare()
    setup_peers_db()
    r = redis.Redis.from_url(REDIS_URL)
    pg_admin = create_engine(PEERS_URL.set(database="postgres"))
    meters = {
        "orderly": Meter(orderly_redis, pg_admin, [runtime.engine]),
        "peers": Meter(r, pg_admin, []),
    }
    systems: dict[str, System] = {
        "celery": PlainCelery(group, r, meters["peers"]),
        "dramatiq": Dramatiq(group, r, meters["peers"]),
        "procrastinate": Procrastinate(group, r, meters["peers"]),
        "orderly": Orderly(group, orderly_redis, meters["orderly"]),
        "orderly_1by1": OrderlyOneByOne(group, orderly_redis, meters["orderly"]),
        "orderly_pipelined": OrderlyPipelined(group, orderly_redis, meters["orderly"]),
    }
    meters["peers"].engines.append(systems["procrastinate"].engine)  # type: ignore[attr-defined]
    out: dict[str, Any] = {
        "messages": n,
        "keys": keys,
        "per_key": per_key,
        "posts": posts,
        "batch": batch_n,
    }
    scenarios: dict[str, dict[str, Any]] = {}
    try:
        for mode, run in (("plain_queued", queued_first), ("plain_submitting", while_submitting)):
            scenarios[mode] = {}
            for name in PLAIN:
                system = systems[name]
                cost = run(system, n)
                scenarios[mode][name] = figures(n, cost, extra_redis=system.extra_redis)
                print(f"{mode:18} {name:14} {scenarios[mode][name]}", flush=True)
            o = scenarios[mode]["orderly"]["per_s"]
            scenarios[mode]["orderly_ratios"] = {
                f"vs_{p}": ratio(o, scenarios[mode][p]["per_s"]) for p in PEERS
            }
            for producer in ("orderly_1by1", "orderly_pipelined"):
                single = scenarios[mode][producer]["per_s"]
                scenarios[mode][f"{producer}_ratios"] = {
                    f"vs_{p}": ratio(single, scenarios[mode][p]["per_s"]) for p in PEERS
                }

        total = keys * per_key
        proc = systems["procrastinate"]
        assert isinstance(proc, Procrastinate)
        proc.polling_s = LOCK_POLLING_S
        orderly = systems["orderly"]
        assert isinstance(orderly, Orderly)
        for mode, run in (
            ("ordered_queued", queued_first),
            ("ordered_submitting", while_submitting),
        ):
            cost = run(proc, total, lambda: proc.submit_ordered(keys, per_key))
            bad = order_violations_procrastinate(r, keys, per_key)
            lock = figures(total, cost, extra_redis=1) | {"order_violations": bad}
            print(f"{mode:18} {'procrastinate':14} {lock}", flush=True)
            scenarios[mode] = {"procrastinate_lock": lock}
            # orderly's producer one message a call, as procrastinate's defers, and 500 a call.
            for name, batch in (
                ("orderly_1by1", 1),
                ("orderly_pipelined", 0),
                ("orderly", Orderly.chunk),
            ):
                submit = functools.partial(
                    funnel.submit, keys, per_key, True, batch or 1, pipelined=not batch
                )
                cost = run(orderly, total, submit)
                _, violations = funnel.release_figures()
                mine = figures(total, cost) | {"order_violations": violations}
                print(f"{mode:18} {name:14} {mine}", flush=True)
                scenarios[mode][name] = mine
                scenarios[mode][f"{name}_ratios"] = {
                    "vs_procrastinate_lock": ratio(mine["per_s"], lock["per_s"])
                }

        for threads in (1, 4):
            mode = f"http_{threads}"
            asgi = figures(posts, http_intake(group, meters["peers"], posts, threads, "asgi"))
            scenarios[mode] = {"asgi": asgi}
            for kind in HTTP_KINDS:
                reset_messages(orderly_redis)
                units = max(1, batch_n // BATCH_SIZE) if kind == "batch" else posts
                if kind == "conversation":
                    units = posts // 2
                cost = http_intake(group, meters["orderly"], units, threads, kind)
                scenarios[mode][kind] = figures(units * http_per_unit(kind), cost)
            mine = scenarios[mode]["messages"]
            scenarios[mode]["orderly_ratios"] = {"vs_asgi": ratio(mine["per_s"], asgi["per_s"])}
            print(f"{mode:18} {scenarios[mode]}", flush=True)
        python = figures(batch_n, python_batch_intake(orderly, batch_n))
        scenarios["batch"] = {
            "python": python,
            "http_1": scenarios["http_1"]["batch"],
            "http_4": scenarios["http_4"]["batch"],
        }
        print(f"{'batch':18} {scenarios['batch']}", flush=True)
    finally:
        group.stop_all()

    plain = [scenarios[m] for m in ("plain_queued", "plain_submitting")]
    live = scenarios["plain_submitting"]
    ordered = [scenarios[m] for m in ("ordered_queued", "ordered_submitting")]
    out["scenarios"] = scenarios
    out |= {
        "plain_vs_celery": min(s["orderly_ratios"]["vs_celery"] for s in plain),
        "plain_vs_procrastinate": min(s["orderly_ratios"]["vs_procrastinate"] for s in plain),
        "ordered_vs_procrastinate": min(
            s["orderly_ratios"]["vs_procrastinate_lock"] for s in ordered
        ),
        # The same with orderly's producer submitting one message a call.
        "plain_1by1_vs_celery": min(s["orderly_1by1_ratios"]["vs_celery"] for s in plain),
        "plain_1by1_vs_procrastinate": min(
            s["orderly_1by1_ratios"]["vs_procrastinate"] for s in plain
        ),
        "ordered_1by1_vs_procrastinate": min(
            s["orderly_1by1_ratios"]["vs_procrastinate_lock"] for s in ordered
        ),
        "ordered_pipelined_vs_procrastinate": min(
            s["orderly_pipelined_ratios"]["vs_procrastinate_lock"] for s in ordered
        ),
        "api_vs_asgi": scenarios["http_4"]["orderly_ratios"]["vs_asgi"],
        # Through the API, the face producers use: the better of 1 and 4 clients.
        "batch_intake_per_s": max(scenarios["batch"][m]["per_s"] for m in ("http_1", "http_4")),
        # The plain path's worst of both producers and both modes, intake included.
        "pg_commits_per_msg": max(
            s[o]["pg_commits_per_msg"] for s in plain for o in ("orderly", "orderly_1by1")
        ),
        "redis_cmds_per_msg": max(
            s[o]["redis_cmds_per_msg"] for s in plain for o in ("orderly", "orderly_1by1")
        ),
        # Submitting while consuming, one message a call (as Celery and dramatiq send).
        "live_vs_celery": live["orderly_pipelined_ratios"]["vs_celery"],
        "live_vs_dramatiq": live["orderly_pipelined_ratios"]["vs_dramatiq"],
        "live_producer_cpu_ms": live["orderly_pipelined"]["producer_cpu_ms_per_msg"],
        # The same, each submit waiting for its own commit (Intake.submit).
        "live_waiting_vs_celery": live["orderly_1by1_ratios"]["vs_celery"],
        "live_waiting_vs_dramatiq": live["orderly_1by1_ratios"]["vs_dramatiq"],
        # Ordered against plain CPU per message, one a call (either producer): the highest.
        "ordered_cpu_vs_plain": max(
            ratio(o[producer]["cpu_ms_per_msg"], p[producer]["cpu_ms_per_msg"])
            for o, p in zip(ordered, plain, strict=True)
            for producer in ("orderly_1by1", "orderly_pipelined")
        ),
    }
    if not args.alone:
        out |= parts(args.quick)
    print(json.dumps(out))


# The benchmarks run after this one's scenarios, each in a process of its own (their last
# line is their figures), and the figures of theirs the summary takes: its name, theirs.
PARTS = {
    "front_door": {
        "api_vs_durable_bare": "api_vs_durable_bare",
        "api_server_cpu_ms": "api_server_cpu_ms",
    },
    "light_load": {
        "paced_p50_vs_celery": "paced_p50_vs_celery",
        "paced_p99_vs_dramatiq": "paced_p99_vs_dramatiq",
    },
    "ordered_delivery": {
        "conversations_vs_sink": "conversations_vs_sink",
        "conversations_vs_procrastinate_lock": "vs_procrastinate_lock",
    },
}


def parts(quick: bool) -> dict[str, Any]:
    """Run the front door, light-load and conversation benchmarks (their output shown as it
    comes); their figures. One that fails is recorded as such, and the others still run."""
    found: dict[str, Any] = {}
    for name, keys in PARTS.items():
        argv = [sys.executable, "-m", f"benchmarks.{name}", *(["--quick"] if quick else [])]
        print(f"--- {' '.join(argv[1:])}", flush=True)
        last = ""
        with subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True) as part:
            assert part.stdout is not None
            for line in part.stdout:
                if last:
                    print(last, end="", flush=True)
                last = line
        try:
            if part.returncode:
                raise ValueError(f"exit code {part.returncode}")
            figures = json.loads(last)
        except ValueError as exc:
            print(last, end="", flush=True)
            found[name] = {"failed": str(exc)}
            found |= dict.fromkeys(keys)
            continue
        found[name] = figures
        found |= {mine: figures[theirs] for mine, theirs in keys.items()}
    return found


if __name__ == "__main__":
    main()
