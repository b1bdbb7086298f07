"""Fault injection: what orderly loses, repeats or misorders when its parts fail under load.

    python -m benchmarks.faults [--quick] [--repeat N] [--window S] [--keep-logs]
                                [--broker redis|rabbitmq]

The run starts servers of its own: a ``redis-server`` without persistence and an ``initdb``
PostgreSQL cluster on free ports (``tooling.servers``), creates and migrates the database, and
runs orderly's API, two workers (one prefork child each) and beat as processes against them.
A real HTTP client sink (``tooling.sink``) is the conversations' channel and the push
subscriber.

**Rounds.** Each round runs a mixed workload for ``--window`` seconds, paced evenly:

- store messages (``POST /messages``, handler ``test.script``): most succeed at once, some
  fail once or twice and are retried by the pool, a few fail four times (FAILED by design);
  each has its own ``correlation_id`` (orderly's idempotency key for intake);
- conversations (``tooling.workload.generate``, 1-5 requests of 1-4 responses) through the
  sink, which answers 5% recoverably (503), 1% for good (400: the group is cancelled), 20%
  202 and ACKs most of those through the API; the request and response ids are the keys;
- events published to a room with a PUSH subscription to the sink (a quarter with a
  ``$delay`` of 0.5-2 s); each event has its own routing key, so a second event made by a
  producer's retry is told from a redelivery (same ``Idempotency-Key``).

Producers do what a real producer does: on a connection error, a timeout, 429 or any 5xx
they wait briefly (``Retry-After`` when given, at most 1 s) and send the same request again;
what the API answered 2xx is *accepted*. When 40% of the round's items are accepted, one
fault is injected (none in the control round, ``none``): ``worker_kill`` (SIGKILL to a whole
worker, which a supervisor starts again at once), ``child_kill`` (SIGKILL to a worker's pool
child), ``flushall`` (``FLUSHALL`` on Redis), ``evict`` (Redis given a small ``maxmemory``
under ``volatile-lru``, as managed services default to, and filled with volatile keys until
some of orderly's are evicted; then the pressure lifted and the filler deleted: the epoch
marker may survive, so only the sweep that reconciles Redis with PostgreSQL notices what is
gone), ``redis_restart`` (Redis killed and started
empty on the same port), ``pg_restart`` (PostgreSQL stopped in ``immediate`` mode, a crash,
and started again) or ``poison`` (a message whose handler kills its worker process; orderly
quarantines it after ``ORDERLY_WORKER_LOST_LIMIT`` deaths in claims of its own as FAILED with
``E_WORKER_LOST``; a death in a claim of several isolates the claim's messages first).
``--quick`` runs each fault once with a small workload; the full run each fault ``--repeat``
(3) times.
A worker process that exits on its own is started again at once, as a supervisor with a
restart-always policy would, and listed in ``worker_exits`` (a worker stops itself when its
service key disappears, which a ``FLUSHALL`` does too).

**Recovery** (per fault, seconds). ``t_fault`` is the moment the injection is complete: the
signal sent (and for ``worker_kill`` the replacement started, not waited for), ``FLUSHALL``
answered, the restarted server answering again, the poison message accepted; the time the
server was down is reported apart as ``outage_s``. From ``t_fault`` the run polls PostgreSQL
every 50 ms for three completion counts: store messages final (OK/FAILED), conversation
responses final (OK/CANCEL/FAILED), push deliveries DELIVERED. The baseline is the first
reading taken right before the injection; a pipeline has recovered at the first reading
after ``t_fault`` whose count is above its baseline (a completion committed in the instant
between that reading and the fault would count as progress: the bias is at most that
instant). ``recovery_s`` of a fault is the latest of the three, i.e. the
time until *every* pipeline completed work again (the producers keep feeding all three, so
there is always work). A pipeline that shows no progress within 60 s is reported in
``recovery_incomplete`` and counts with the time waited. ``recovery_s_max`` is the largest
``recovery_s``. ``settle_s`` (per round) is ``t_fault`` until everything accepted in the round
is final or delivered; it includes designed waits (retry backoffs, a PARTLY_FAILED rest of
1 s, ``$delay``) and the end of the round's production. So the run's first round of each
repeat is a control round (``none``: the same workload, no fault), and
``settle_excess_s_by_fault`` is each fault round's ``settle_s`` less the control rounds' median
(``settle_s_control``): the time a fault adds until everything in flight around it is done,
``settle_excess_s_max`` the largest. Being a difference of two loaded runs it is noisy, and
may come out below 0.

**Figures.** After the last round the run waits (bounded) for everything to settle, then
counts from the sink's log and PostgreSQL:

- ``accepted``: every item the API answered 2xx (messages, requests, responses, events, poison);
- ``lost``: accepted and, at the end, not final (messages), not delivered with a 2xx while its
  group was not cancelled by the client (responses), or never delivered with a 2xx (events);
- ``duplicates``: further 2xx deliveries of an already delivered item; ``duplicates_same_key``
  those under the same ``Idempotency-Key`` (allowed: at least once), ``duplicates_other`` a
  second key for the same item (a second event from a retried publish: the publish API takes
  no idempotency key, so ``ambiguous_publishes`` counts the publishes that were retried after
  an answer that did not say whether the first try was stored);
- ``order_violations``: per conversation, a response whose first 2xx delivery came after the
  first 2xx delivery of a later response, not counting responses delivered with
  ``X-Orderly-Late: true`` (``late_responses``: those responses);
- ``poison_quarantined``: poison messages FAILED with ``E_WORKER_LOST``.

The last line printed (stdout) is one JSON object with these keys, ``recovery_s_max`` and the
details; progress goes to stderr. Every server and process the run started is stopped on the
way out, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tooling.workload import RECOVERABLE_4XX, Workload, generate

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from tooling.processes import Managed, ProcessGroup
    from tooling.servers import PostgresServer, RedisServer
    from tooling.sink import Sink


def _evict_some(client: Any) -> int:
    """Fill Redis with volatile keys under a small ``maxmemory`` and ``volatile-lru`` until
    a quarter of the keys it held (orderly's: those with a TTL are the candidates) are
    evicted; then lift the pressure (no limit, ``noeviction``) and delete the filler. How
    many of the keys it held are gone."""
    held = [k for k in client.scan_iter(count=1000) if client.pttl(k) > 0]
    keep = len(held) - max(1, len(held) // 4)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(used + 256 * 1024))
    client.config_set("maxmemory-policy", "volatile-lru")
    blob, n = "x" * 1024, 0
    try:
        while n < 20_000:
            client.set(f"fault:filler:{n}", blob, ex=600)
            n += 1
            if n % 100 == 0 and held and client.exists(*held) <= keep:
                break
    finally:
        client.config_set("maxmemory", "0")
        client.config_set("maxmemory-policy", "noeviction")
        for start in range(0, n, 1000):
            client.delete(*[f"fault:filler:{i}" for i in range(start, min(n, start + 1000))])
    return len(held) - (int(client.exists(*held)) if held else 0)


FAULTS = (
    "none",
    "worker_kill",
    "child_kill",
    "flushall",
    "evict",
    "redis_restart",
    "pg_restart",
    "poison",
)
ROOM = "faults"
ORIGIN = "chat"
SOURCE = "faults"
PIPELINES = ("messages", "conversations", "pushes")
POLL_S = 0.05
RECOVERY_DEADLINE_S = 60.0
# Conversation timings shortened for a run of minutes (the production defaults wait up to
# 30 s for a dead sender's lease and 5 s for an ACK); MESSAGE_TTL keeps its default.
TIMINGS = {
    "ORDERLY_HANDLER_MODULES": "tooling.handlers",
    "AURA_QUEUE_MANAGER_SENT_MESSAGE_TTL": "1000",
    "AURA_QUEUE_MANAGER_AWAITED_TIME_WHEN_RETRIES_END": "500",
    "AURA_QUEUE_MANAGER_AWAITED_MESSAGES_INTERVAL": "1000",
    "AURA_QUEUE_MANAGER_MAX_PENDING_TTL": "4000",
    "AURA_QUEUE_MANAGER_MAX_PENDING_TTL_MARGIN": "500",
}
CONFIG = {"asynch.partlyFailedIntervalSec": "1", "asynch.partlyFailedRepeatTimeSec": "1"}
CHANNEL = {"delivery_delay_ms": 50, "multiplier": 2.0, "attempts": 3, "timeout_ms": 1000}
SINK = {
    "p_recoverable": 0.05,
    "p_non_recoverable": 0.01,
    "p_async": 0.20,
    "p_never_ack": 0.20,
    "ack_delay_ms": [5, 100],
    # Pushes (logged under the room's name) are always taken.
    "rules": [{"match": {"conversation_id": ROOM}, "status": 200}],
}


def log(text: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --- accounting: pure functions over the sink's log (unit-tested) ---------------------------


def delivered(status: int) -> bool:
    return 200 <= status < 300


def fatal(status: int) -> bool:
    return 400 <= status < 500 and status not in RECOVERABLE_4XX


def item_of(arrival: Mapping[str, Any]) -> str:
    """What an arrival delivers: a response id, or for a push its event's routing key."""
    if arrival["conversation_id"] == ROOM:
        return str(arrival["request_id"])
    return str(arrival["response_id"])


def first_deliveries(arrivals: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Each item's first 2xx arrival."""
    first: dict[str, Mapping[str, Any]] = {}
    for a in sorted(arrivals, key=lambda a: int(a["seq"])):
        if delivered(int(a["status"])):
            first.setdefault(item_of(a), a)
    return first


def duplicates(arrivals: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """2xx deliveries beyond each item's first: (under a key already delivered, under another)."""
    keys: dict[str, set[str]] = {}
    same = other = 0
    for a in sorted(arrivals, key=lambda a: int(a["seq"])):
        if not delivered(int(a["status"])):
            continue
        seen = keys.setdefault(item_of(a), set())
        if a["key"] in seen:
            same += 1
        elif seen:
            other += 1
        seen.add(str(a["key"]))
    return same, other


def order_violations(
    turns: Mapping[str, Sequence[tuple[str, Sequence[str]]]],
    arrivals: Iterable[Mapping[str, Any]],
) -> list[str]:
    """Responses first delivered after a later response of their conversation.

    Late responses (delivered with ``X-Orderly-Late: true``) go after later requests by
    design; they are left out, as is every redelivery (counted as a duplicate).
    """
    firsts = first_deliveries(a for a in arrivals if a["conversation_id"] != ROOM)
    found: list[str] = []
    for cid, requests in turns.items():
        position = {sid: i for i, sid in enumerate(s for _, r in requests for s in r)}
        furthest: str | None = None
        for a in sorted(
            (a for sid, a in firsts.items() if sid in position), key=lambda a: int(a["seq"])
        ):
            if a.get("late") == "true":
                continue
            sid = str(a["response_id"])
            if furthest is not None and position[furthest] > position[sid]:
                found.append(f"{cid}: {furthest} before {sid}")
            if furthest is None or position[sid] > position[furthest]:
                furthest = sid
    return found


def late_responses(arrivals: Iterable[Mapping[str, Any]]) -> int:
    """Responses whose delivery carried ``X-Orderly-Late: true``."""
    firsts = first_deliveries(a for a in arrivals if a["conversation_id"] != ROOM)
    return sum(1 for a in firsts.values() if a.get("late") == "true")


def lost_responses(
    accepted: Mapping[str, str], arrivals: Iterable[Mapping[str, Any]]
) -> tuple[list[str], list[str]]:
    """Accepted responses (id -> request id) never delivered, and those delivered after the
    client refused their group (a fatal answer to a response of the same request).

    The refusal cancels the request's undelivered responses, so those are not lost.
    """
    arrivals = [a for a in arrivals if a["conversation_id"] != ROOM]
    refused = {str(a["request_id"]) for a in arrivals if fatal(int(a["status"]))}
    firsts = first_deliveries(arrivals)
    fatal_seq: dict[str, int] = {}
    for a in sorted(arrivals, key=lambda a: int(a["seq"])):
        if fatal(int(a["status"])):
            fatal_seq.setdefault(str(a["request_id"]), int(a["seq"]))
    lost = sorted(sid for sid, rid in accepted.items() if sid not in firsts and rid not in refused)
    after = sorted(
        sid
        for sid, rid in accepted.items()
        if sid in firsts and rid in fatal_seq and int(firsts[sid]["seq"]) > fatal_seq[rid]
    )
    return lost, after


def recovery(
    samples: Sequence[tuple[float, Mapping[str, int]]], t_inject: float, t_fault: float
) -> dict[str, float | None]:
    """Per pipeline: seconds from ``t_fault`` to the first reading taken after it whose count
    is above the last reading taken before ``t_inject`` (None: no such reading)."""
    before = [counts for t, counts in samples if t <= t_inject]
    out: dict[str, float | None] = dict.fromkeys(PIPELINES)
    if not before:
        return out
    baseline = before[-1]
    for name in PIPELINES:
        for t, counts in samples:
            if t >= t_fault and counts[name] > baseline[name]:
                out[name] = t - t_fault
                break
    return out


# --- producers ------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int  # 0: gave up (no answer within the deadline)
    body: Any
    tries: int
    ambiguous: bool  # a retry followed an answer that did not say whether a try was stored


class Producer:
    """POSTs that retry what a real producer retries: connection errors, timeouts, 429, 5xx."""

    def __init__(
        self, base_url: str, headers: Mapping[str, str], deadline_s: float = 120.0
    ) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=10.0, headers=dict(headers))
        self.deadline_s = deadline_s
        self.retries = 0
        self.lock = threading.Lock()

    def post(self, path: str, body: Mapping[str, Any]) -> Answer:
        deadline = time.monotonic() + self.deadline_s
        tries = 0
        ambiguous = False
        while True:
            tries += 1
            wait = 0.1
            try:
                answer = self.client.post(path, json=dict(body))
            except httpx.ConnectError:
                pass  # never reached the API: not ambiguous
            except httpx.HTTPError:
                ambiguous = True  # sent, no answer
            else:
                if answer.status_code < 500 and answer.status_code != 429:
                    try:
                        data = answer.json()
                    except ValueError:
                        data = answer.text
                    return Answer(answer.status_code, data, tries, ambiguous)
                ambiguous = ambiguous or answer.status_code != 503
                with contextlib.suppress(ValueError):
                    wait = float(answer.headers.get("retry-after", wait))
            if time.monotonic() + wait > deadline:
                return Answer(0, None, tries, ambiguous)
            with self.lock:
                self.retries += 1
            time.sleep(min(max(wait, 0.05), 1.0))

    def close(self) -> None:
        self.client.close()


@dataclass
class Ledger:
    """What the producers sent and what the API accepted, across rounds."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    messages: dict[str, int] = field(default_factory=dict)  # correlation id -> fail_times
    poison: list[str] = field(default_factory=list)
    requests: dict[str, str] = field(default_factory=dict)  # request id -> conversation
    responses: dict[str, str] = field(default_factory=dict)  # response id -> request id
    events: dict[str, str] = field(default_factory=dict)  # routing key -> correlation id
    ambiguous_publishes: int = 0
    refused: list[str] = field(default_factory=list)  # "what: status body"
    turns: dict[str, list[tuple[str, list[str]]]] = field(default_factory=dict)

    def accepted(self) -> dict[str, int]:
        return {
            "messages": len(self.messages),
            "poison": len(self.poison),
            "requests": len(self.requests),
            "responses": len(self.responses),
            "events": len(self.events),
        }

    def refuse(self, what: str, answer: Answer) -> None:
        with self.lock:
            self.refused.append(f"{what}: {answer.status} {str(answer.body)[:200]}")


@dataclass
class RoundPlan:
    number: int
    fault: str
    window_s: float
    messages: int
    conversations: int
    events: int
    settle_s: float


def _paced(n: int, window_s: float, stop: threading.Event) -> Iterable[int]:
    """0..n-1, the i-th at i/n of the window (the workload's arrival rate)."""
    start = time.monotonic()
    for i in range(n):
        due = start + window_s * i / max(n, 1)
        if stop.wait(max(0.0, due - time.monotonic())):
            return
        yield i


def produce_messages(
    plan: RoundPlan, producer: Producer, ledger: Ledger, stop: threading.Event
) -> None:
    rng = random.Random(f"messages:{plan.number}")
    base = datetime.now(UTC)
    for i in _paced(plan.messages, plan.window_s, stop):
        fail_times = rng.choices((0, 1, 2, 4), weights=(80, 10, 6, 4))[0]
        cid = f"r{plan.number}-m{i}"
        body = {
            "service": "test",
            "operation": "script",
            "correlation_id": cid,
            "source_system": SOURCE,
            "msg_timestamp": (base + timedelta(milliseconds=i)).isoformat(),
            "payload": {"fail_times": fail_times},
        }
        answer = producer.post("/messages", body)
        if delivered(answer.status):
            with ledger.lock:
                ledger.messages[cid] = fail_times
        else:
            ledger.refuse(cid, answer)


def produce_conversations(
    plan: RoundPlan, producer: Producer, ledger: Ledger, stop: threading.Event
) -> None:
    workload: Workload = generate(
        seed=plan.number, conversations=plan.conversations, prefix=f"r{plan.number}-"
    )
    with ledger.lock:
        ledger.turns.update(workload.turns)
    events = workload.events
    for i in _paced(len(events), plan.window_s, stop):
        event = events[i]
        if event.kind == "request":
            answer = producer.post(
                f"/conversations/{event.conversation_id}/requests",
                {"request_id": event.request_id, "origin": ORIGIN},
            )
            what = event.request_id
        else:
            answer = producer.post(
                f"/conversations/{event.conversation_id}/responses",
                {
                    "request_id": event.request_id,
                    "response_id": event.response_id,
                    "payload": {"text": f"answer {event.response_id}"},
                    "last": event.last,
                },
            )
            what = event.response_id
        if not delivered(answer.status):
            ledger.refuse(what, answer)
            continue
        with ledger.lock:
            if event.kind == "request":
                ledger.requests[event.request_id] = event.conversation_id
            else:
                ledger.responses[event.response_id] = event.request_id


def produce_events(
    plan: RoundPlan, producer: Producer, ledger: Ledger, stop: threading.Event
) -> None:
    rng = random.Random(f"events:{plan.number}")
    for i in _paced(plan.events, plan.window_s, stop):
        key = f"ev.r{plan.number}.e{i}"
        body: dict[str, Any] = {"routing_key": key, "payload": {"n": i}}
        if rng.random() < 0.25:
            body["$delay"] = rng.randint(500, 2000)
        answer = producer.post(f"/rooms/{ROOM}/events", body)
        if delivered(answer.status):
            with ledger.lock:
                ledger.events[key] = str(answer.body["correlation_id"])
                ledger.ambiguous_publishes += int(answer.ambiguous)
        else:
            ledger.refuse(key, answer)


# --- the system under test ------------------------------------------------------------------


class System:
    """The servers, orderly's processes, the sink and the run's own database connection."""

    def __init__(self, stack: contextlib.ExitStack, log_dir: Path, broker: str = "redis") -> None:
        from tooling.servers import PostgresServer, RabbitVhost, RedisServer
        from tooling.sink import Sink

        self.redis: RedisServer = stack.enter_context(RedisServer())
        self.pg: PostgresServer = stack.enter_context(PostgresServer())
        log(f"redis-server on port {self.redis.port}, PostgreSQL on port {self.pg.port}")
        os.environ.update(TIMINGS)
        os.environ["ORDERLY_DATABASE_URL"] = self.pg.url("orderly")
        os.environ["ORDERLY_REDIS_URL"] = self.redis.url
        for name in ("ORDERLY_BROKER_URL", "ORDERLY_TRACK_REDIS_URL"):
            os.environ.pop(name, None)
        if broker == "rabbitmq":
            # The machine's RabbitMQ, in a virtual host of the run's own.
            vhost = RabbitVhost(f"orderly-faults-{os.getpid()}-{int(time.time())}")
            stack.enter_context(vhost)
            os.environ["ORDERLY_BROKER_URL"] = vhost.url
            log(f"broker: RabbitMQ, virtual host {vhost.name}")
        self.sink: Sink = stack.enter_context(Sink())
        self.log_dir = log_dir
        self.workers: list[Managed] = []
        self.generation = 0
        # A supervisor's view: workers that exited on their own, started again.
        self.worker_exits: list[str] = []
        self.workers_lock = threading.Lock()
        self._supervising = threading.Event()
        self.group: ProcessGroup | None = None
        self.engine: Engine | None = None
        self.auth: dict[str, str] = {}
        self.port = 0
        stack.callback(self.stop)

    def start(self) -> None:
        from sqlalchemy import create_engine

        from orderly.worker import configuration
        from orderly.worker.db import schema
        from tooling.processes import ProcessGroup, free_port, wait_for_log

        url = os.environ["ORDERLY_DATABASE_URL"]
        schema.create_database(url)
        schema.upgrade(url)
        self.engine = create_engine(url, pool_pre_ping=True, pool_size=2)
        from orderly.worker.runtime import get_runtime
        from tooling.apikeys import bearer

        self.auth = bearer(self.engine)
        runtime = get_runtime()
        runtime.startup_check()
        for code, value in CONFIG.items():
            configuration.set_value(runtime.engine, code, value)
        runtime.engine.dispose()

        self.group = ProcessGroup.create(self.log_dir)
        self.port = free_port()
        self.group.start_api(self.port, extra_env={"ORDERLY_NODE_CODE": "faults-api"})
        self.workers = [self._start_worker(i) for i in range(2)]
        beat = self.group.start_beat(extra_env={"ORDERLY_NODE_CODE": "faults-beat"})
        for w in self.workers:
            wait_for_log(w, "ready.", timeout=120)
        wait_for_log(beat, "ticker every", timeout=120)
        self._supervising.set()
        threading.Thread(target=self._supervise, name="supervisor", daemon=True).start()

        http = httpx.Client(base_url=self.api, timeout=30, headers=self.auth)
        for path, body, method in (
            (f"/channels/{ORIGIN}", {"url": self.sink.url, **CHANNEL}, "PUT"),
            (
                "/rooms",
                {
                    "name": ROOM,
                    "delivery_delay_ms": 100,
                    "delivery_delay_multiplier": 2.0,
                    "delivery_attempts": 5,
                },
                "POST",
            ),
            (
                f"/rooms/{ROOM}/subscriptions",
                {"name": "push", "kind": "PUSH", "push_url": self.sink.url, "timeout_ms": 1000},
                "POST",
            ),
        ):
            answer = http.request(method, path, json=body)
            if answer.status_code not in (200, 201):
                raise RuntimeError(f"{method} {path}: {answer.status_code} {answer.text}")
        http.close()
        self.sink.configure(**SINK, orderly_url=self.api)
        log(f"API on port {self.port}, 2 workers and beat started; logs in {self.log_dir}")

    def _start_worker(self, i: int) -> Managed:
        assert self.group is not None
        self.generation += 1
        return self.group.start_worker(
            f"w{i}-{self.generation}", concurrency=1, node_code=f"faults-w{i}"
        )

    def _supervise(self) -> None:
        """Start again a worker that exited (as systemd's Restart=always would), and say so."""
        while self._supervising.is_set():
            with self.workers_lock:
                for i, w in enumerate(self.workers):
                    if self._supervising.is_set() and not w.alive():
                        self.worker_exits.append(f"{w.name} exit code {w.proc.returncode}")
                        log(f"worker {w.name} exited (code {w.proc.returncode}): started again")
                        assert self.group is not None
                        self.group.procs.remove(w)
                        self.workers[i] = self._start_worker(i)
            time.sleep(0.2)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._supervising.clear()
        with self.workers_lock:
            pass  # the supervisor is done with the group
        if self.group is not None:
            self.group.stop_all()
        if self.engine is not None:
            self.engine.dispose()

    # --- faults ---------------------------------------------------------------------------

    def inject(self, fault: str, plan: RoundPlan, producer: Producer, ledger: Ledger) -> str:
        """Inject ``fault``; a line saying what was done."""
        import redis

        assert self.group is not None
        if fault == "none":
            return "no fault: the control round"
        if fault == "worker_kill":
            i = plan.number % 2
            with self.workers_lock:
                victim = self.workers[i]
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(victim.proc.pid, signal.SIGKILL)
                victim.proc.wait(10)
                self.group.procs.remove(victim)
                self.workers[i] = self._start_worker(i)
            return f"SIGKILL to worker w{i} (pid {victim.proc.pid} and its child), restarted"
        if fault == "child_kill":
            master = self.workers[plan.number % 2]
            children = subprocess.run(
                ["pgrep", "-P", str(master.proc.pid)], capture_output=True, text=True
            ).stdout.split()
            if not children:
                return f"no pool child of {master.name} found: nothing killed"
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(children[0]), signal.SIGKILL)
            return f"SIGKILL to pool child {children[0]} of {master.name}"
        if fault == "flushall":
            client = redis.Redis.from_url(self.redis.url)
            client.flushall()
            client.close()
            return "FLUSHALL"
        if fault == "evict":
            client = redis.Redis.from_url(self.redis.url)
            try:
                evicted = _evict_some(client)
            finally:
                client.close()
            return (
                f"{evicted} of orderly's keys evicted under volatile-lru, then the pressure lifted"
            )
        if fault == "redis_restart":
            self.redis.restart(kill=True)
            return "redis-server killed and started empty"
        if fault == "pg_restart":
            self.pg.restart(mode="immediate")
            return "PostgreSQL stopped (immediate) and started"
        if fault == "poison":
            cid = f"r{plan.number}-poison"
            answer = producer.post(
                "/messages",
                {
                    "service": "test",
                    "operation": "poison",
                    "correlation_id": cid,
                    "source_system": SOURCE,
                    "msg_timestamp": datetime.now(UTC).isoformat(),
                    "payload": {},
                },
            )
            if not delivered(answer.status):
                ledger.refuse(cid, answer)
                return f"poison message refused: {answer.status}"
            with ledger.lock:
                ledger.poison.append(cid)
            return f"poison message {cid} accepted"
        raise ValueError(f"unknown fault {fault!r}")

    # --- readings -------------------------------------------------------------------------

    def counts(self) -> dict[str, int] | None:
        """Completions so far per pipeline (None: PostgreSQL did not answer)."""
        from sqlalchemy import text

        assert self.engine is not None
        try:
            with self.engine.connect() as conn:
                row = conn.execute(
                    text(
                        "SELECT"
                        " (SELECT count(*) FROM message WHERE source_system = :source"
                        "   AND state IN ('OK', 'FAILED')) AS messages,"
                        " (SELECT count(*) FROM message WHERE service_name = 'conversation'"
                        "   AND operation_name = 'response'"
                        "   AND state IN ('OK', 'CANCEL', 'FAILED')) AS conversations,"
                        " (SELECT count(*) FROM delivery WHERE state = 'DELIVERED') AS pushes"
                    ),
                    {"source": SOURCE},
                ).one()
        except Exception:
            return None
        return {"messages": row.messages, "conversations": row.conversations, "pushes": row.pushes}

    def message_states(self) -> dict[str, tuple[str, str | None]]:
        """correlation id -> (state, failed_error_code) of the run's store messages."""
        from sqlalchemy import text

        assert self.engine is not None
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT correlation_id, state, failed_error_code FROM message"
                    " WHERE source_system = :source"
                ),
                {"source": SOURCE},
            ).all()
        return {r.correlation_id: (r.state, r.failed_error_code) for r in rows}

    def conversation_states(self) -> dict[str, str]:
        from sqlalchemy import text

        assert self.engine is not None
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT correlation_id, state FROM message WHERE service_name = 'conversation'"
                )
            ).all()
        return {r.correlation_id: r.state for r in rows}

    def delivery_states(self) -> dict[str, int]:
        from sqlalchemy import text

        assert self.engine is not None
        with self.engine.connect() as conn:
            rows = conn.execute(text("SELECT state, count(*) AS n FROM delivery GROUP BY state"))
            return {r.state: int(r.n) for r in rows}


# --- rounds ---------------------------------------------------------------------------------


def unsettled(system: System, ledger: Ledger, prefix: str = "") -> dict[str, int]:
    """Accepted items (whose id starts with ``prefix``) not yet final or delivered."""
    with ledger.lock:
        messages = [c for c in [*ledger.messages, *ledger.poison] if c.startswith(prefix)]
        responses = {s: r for s, r in ledger.responses.items() if s.startswith(prefix)}
        events = [k for k in ledger.events if k.startswith(f"ev.{prefix}")]
    states = system.message_states()
    open_messages = sum(1 for c in messages if states.get(c, ("?",))[0] not in ("OK", "FAILED"))
    conv = system.conversation_states()
    open_responses = sum(1 for s in responses if conv.get(s) not in ("OK", "CANCEL", "FAILED"))
    firsts = first_deliveries(system.sink.arrivals())
    open_events = sum(1 for k in events if k not in firsts)
    return {"messages": open_messages, "responses": open_responses, "events": open_events}


def wait_settled(
    system: System, ledger: Ledger, prefix: str, deadline_s: float
) -> tuple[bool, dict[str, int]]:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            left = unsettled(system, ledger, prefix)
        except Exception as exc:  # PostgreSQL still coming back
            left = {"unreadable": 1}
            log(f"settle check failed: {exc.__class__.__name__}")
        if not any(left.values()):
            return True, left
        if time.monotonic() > deadline:
            return False, left
        time.sleep(0.2)


def run_round(
    system: System, plan: RoundPlan, producer: Producer, ledger: Ledger
) -> dict[str, Any]:
    stop = threading.Event()
    total = plan.messages + plan.events
    before = len(ledger.messages) + len(ledger.events)
    threads = [
        threading.Thread(target=fn, args=(plan, producer, ledger, stop), name=fn.__name__)
        for fn in (produce_messages, produce_conversations, produce_events)
    ]
    for t in threads:
        t.start()
    try:
        # Under load first: 40% of the round's messages and events accepted.
        while len(ledger.messages) + len(ledger.events) - before < 0.4 * total:
            if not any(t.is_alive() for t in threads):
                break
            time.sleep(POLL_S)
        # The baseline: the last reading before the fault.
        before_fault = None
        while before_fault is None:
            before_fault = system.counts()
        t_inject = time.monotonic()
        samples: list[tuple[float, dict[str, int]]] = [(t_inject, before_fault)]
        what = system.inject(plan.fault, plan, producer, ledger)
        t_fault = time.monotonic()
        log(f"round {plan.number} {plan.fault}: {what} ({t_fault - t_inject:.3f} s)")
        deadline = t_fault + RECOVERY_DEADLINE_S
        progress: dict[str, float | None] = dict.fromkeys(PIPELINES)
        while time.monotonic() < deadline:
            counts = system.counts()
            if counts is not None:
                samples.append((time.monotonic(), counts))
                progress = recovery(samples, t_inject, t_fault)
                if all(v is not None for v in progress.values()):
                    break
            time.sleep(POLL_S)
        for t in threads:
            t.join()
    finally:
        stop.set()
        for t in threads:
            t.join()
    incomplete = [p for p, v in progress.items() if v is None]
    waited = time.monotonic() - t_fault
    recovery_s = max((v if v is not None else waited) for v in progress.values())
    poison_s: float | None = None
    if plan.fault == "poison" and ledger.poison:
        cid = ledger.poison[-1]
        end = time.monotonic() + 120
        while time.monotonic() < end:
            with contextlib.suppress(Exception):
                if system.message_states().get(cid, ("?",))[0] == "FAILED":
                    poison_s = time.monotonic() - t_fault
                    break
            time.sleep(0.1)
    settled, left = wait_settled(system, ledger, f"r{plan.number}-", plan.settle_s)
    settle_s = time.monotonic() - t_fault
    result = {
        "round": plan.number,
        "fault": plan.fault,
        "outage_s": round(t_fault - t_inject, 3),
        "recovery_s": round(recovery_s, 3),
        "pipelines_s": {p: None if v is None else round(v, 3) for p, v in progress.items()},
        "recovery_incomplete": incomplete,
        "settle_s": round(settle_s, 3) if settled else None,
        "unsettled": {k: v for k, v in left.items() if v},
    }
    if poison_s is not None:
        result["poison_quarantine_s"] = round(poison_s, 3)
    pipelines = ", ".join(
        f"{p} {v:.3f}" if v is not None else f"{p} none" for p, v in progress.items()
    )
    log(
        f"round {plan.number} {plan.fault}: recovery {recovery_s:.3f} s ({pipelines})"
        + (f", settled after {settle_s:.3f} s" if settled else f", NOT settled: {left}")
    )
    return result


def account(system: System, ledger: Ledger) -> dict[str, Any]:
    """The run's figures from the sink's log and PostgreSQL."""
    arrivals = system.sink.arrivals()
    states = system.message_states()
    lost_messages = sorted(
        c
        for c in [*ledger.messages, *ledger.poison]
        if states.get(c, ("?", None))[0] not in ("OK", "FAILED")
    )
    wrong_outcome = sorted(
        f"{c}: {states[c][0]} {states[c][1]}"
        for c, fail_times in ledger.messages.items()
        if c in states
        and states[c][0] in ("OK", "FAILED")
        and states[c][0] != ("FAILED" if fail_times > 3 else "OK")
    )
    lost_resp, after_cancel = lost_responses(ledger.responses, arrivals)
    firsts = first_deliveries(arrivals)
    lost_events = sorted(k for k in ledger.events if k not in firsts)
    same, other = duplicates(arrivals)
    violations = order_violations(ledger.turns, arrivals)
    quarantined = sum(1 for c in ledger.poison if states.get(c) == ("FAILED", "E_WORKER_LOST"))
    accepted = ledger.accepted()
    return {
        "accepted": sum(accepted.values()),
        "accepted_by_kind": accepted,
        "lost": len(lost_messages) + len(lost_resp) + len(lost_events),
        "lost_by_kind": {
            "messages": len(lost_messages),
            "responses": len(lost_resp),
            "events": len(lost_events),
        },
        "lost_examples": (lost_messages[:5] + lost_resp[:5] + lost_events[:5]),
        "lost_message_states": sorted({str(states.get(c, ("absent",))[0]) for c in lost_messages}),
        "duplicates": same + other,
        "duplicates_same_key": same,
        "duplicates_other": other,
        "ambiguous_publishes": ledger.ambiguous_publishes,
        "order_violations": len(violations),
        "order_violation_examples": violations[:5],
        "late_responses": late_responses(arrivals),
        "delivered_after_cancel": len(after_cancel),
        "poison_quarantined": quarantined,
        "wrong_outcome": len(wrong_outcome),
        "wrong_outcome_examples": wrong_outcome[:5],
        "refused": len(ledger.refused),
        "refused_examples": ledger.refused[:5],
        "deliveries_by_state": system.delivery_states(),
    }


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="each fault once, small: about 2 min")
    parser.add_argument("--repeat", type=int, default=None, help="rounds per fault (full: 3)")
    parser.add_argument("--window", type=float, default=None, help="seconds of load per round")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    parser.add_argument(
        "--broker",
        choices=("redis", "rabbitmq"),
        default="redis",
        help="the Celery broker: the run's Redis, or the machine's RabbitMQ (a vhost of its own)",
    )
    args = parser.parse_args()
    repeat = args.repeat or (1 if args.quick else 3)
    window = args.window or (5.0 if args.quick else 10.0)
    sizes = (25, 5, 15) if args.quick else (80, 15, 40)  # per round: messages, convs, events

    signal.signal(signal.SIGTERM, _interrupt)
    log_dir = Path(tempfile.mkdtemp(prefix="orderly-faults-"))
    plans = [
        RoundPlan(n * len(FAULTS) + i + 1, fault, window, *sizes, 20 if args.quick else 60)
        for n in range(repeat)
        for i, fault in enumerate(FAULTS)
    ]
    t0 = time.monotonic()
    rounds: list[dict[str, Any]] = []
    ledger = Ledger()
    try:
        with contextlib.ExitStack() as stack:
            system = System(stack, log_dir, args.broker)
            system.start()
            producer = Producer(system.api, system.auth)
            stack.callback(producer.close)
            for plan in plans:
                rounds.append(run_round(system, plan, producer, ledger))
            settled, left = wait_settled(system, ledger, "", 20 if args.quick else 180)
            if not settled:
                log(f"not settled at the end: {left}")
            figures = account(system, ledger)
            worker_exits = list(system.worker_exits)
    except BaseException:
        log(f"stopped early; every server and process is stopped; logs in {log_dir}")
        raise
    if args.keep_logs:
        log(f"logs in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    faulted = [r for r in rounds if r["fault"] != "none"]
    recoveries = [r["recovery_s"] for r in faulted]
    settles = [r["settle_s"] for r in faulted if r["settle_s"] is not None]
    by_fault: dict[str, list[float]] = {}
    for r in faulted:
        by_fault.setdefault(r["fault"], []).append(r["recovery_s"])
    # What a fault adds to a round's settling: its settle_s less the control rounds' (median).
    controls = sorted(r["settle_s"] for r in rounds if r["fault"] == "none" and r["settle_s"])
    control = controls[len(controls) // 2] if controls else None
    excess: dict[str, list[float]] = {}
    for r in faulted:
        if control is not None and r["settle_s"] is not None:
            excess.setdefault(r["fault"], []).append(round(r["settle_s"] - control, 3))
    out = {
        "broker": args.broker,
        "accepted": figures.pop("accepted"),
        "lost": figures.pop("lost"),
        "duplicates": figures.pop("duplicates"),
        "order_violations": figures.pop("order_violations"),
        "late_responses": figures.pop("late_responses"),
        "poison_quarantined": figures.pop("poison_quarantined"),
        "recovery_s_max": max(recoveries),
        "recovery_s_by_fault": by_fault,
        "recovery_incomplete": sum(1 for r in rounds if r["recovery_incomplete"]),
        "settle_s_max": max(settles) if settles else None,
        "settle_s_control": control,
        "settle_excess_s_by_fault": excess,
        "settle_excess_s_max": max((x for xs in excess.values() for x in xs), default=None),
        "unsettled_rounds": sum(1 for r in rounds if r["settle_s"] is None),
        **figures,
        "producer_retries": producer.retries,
        "worker_exits": worker_exits,
        "rounds": rounds,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    log(
        f"accepted {out['accepted']}, lost {out['lost']}, duplicates {out['duplicates']} "
        f"({out['duplicates_same_key']} same key), order violations {out['order_violations']}, "
        f"late {out['late_responses']}, poison quarantined {out['poison_quarantined']}, "
        f"recovery max {out['recovery_s_max']} s, settle excess max {out['settle_excess_s_max']} s"
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
