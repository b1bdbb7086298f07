"""Test set-up: a fresh PostgreSQL database for the run and a Redis DB flushed per test.

Both are the real servers on this machine. When one is absent the tests that need it are
skipped locally and fail in CI (CI=true).

Each test gets its kind (tests/kinds.py) as a marker: ``pytest -m "not e2e"`` is the quick
run. While a test runs, what its kind rules out fails it: a unit test may not reach
PostgreSQL or Redis, and only an end-to-end test may start a process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Generator, Iterator
from graphlib import TopologicalSorter
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import pytest

from tooling.processes import checkout_env
from tooling.servers import RabbitVhost

# Settings are read from the environment at import time of the app modules: set them first.
_RUN = uuid.uuid4().hex[:8]
PG_ADMIN_URL = os.environ.get(
    "ORDERLY_TEST_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
)
TEST_DB = f"orderly_test_{_RUN}"
TEST_DB_URL = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{TEST_DB}"
REDIS_DATABASES = 16  # Redis's default ``databases``


def worker_redis_url(base: str, worker: str | None) -> str:
    """The Redis URL of one pytest-xdist worker: the base URL's DB plus the worker's index
    (``gw0`` the base DB, ``gw1`` the next one, ...); the base itself without xdist."""
    parts = urlsplit(base)
    first = int(parts.path.strip("/") or 0)
    index = int(worker.removeprefix("gw")) if worker else 0
    if not 0 <= first + index < REDIS_DATABASES:
        raise RuntimeError(
            f"xdist worker {worker} would use Redis DB {first + index} of {base}: Redis has"
            f" DBs 0..{REDIS_DATABASES - 1}; use fewer workers or a lower ORDERLY_TEST_REDIS_URL"
        )
    return parts._replace(path=f"/{first + index}").geturl()


# Every xdist worker is a process of its own: its own database (the uuid) and Redis DB.
TEST_REDIS_URL = worker_redis_url(
    os.environ.get("ORDERLY_TEST_REDIS_URL", "redis://127.0.0.1:6379/13"),
    os.environ.get("PYTEST_XDIST_WORKER"),
)
os.environ.update(
    {
        "ORDERLY_DATABASE_URL": TEST_DB_URL,
        "ORDERLY_REDIS_URL": TEST_REDIS_URL,
        "ORDERLY_HANDLER_MODULES": "tooling.handlers",
        # The test servers (sinks, recorders) listen on loopback: allowed explicitly.
        "ORDERLY_OUTBOUND_ALLOW": "127.0.0.1",
        "ORDERLY_HEARTBEAT_INTERVAL": "300",
        "ORDERLY_NODE_CODE": f"pytest-{_RUN}",
    }
)
for _shared in ("ORDERLY_BROKER_URL", "ORDERLY_TRACK_REDIS_URL"):
    os.environ.pop(_shared, None)
# The broker profile: ORDERLY_TEST_BROKER=rabbitmq runs the tests (and every process they
# start) on the machine's RabbitMQ, in a virtual host of each xdist worker's own; otherwise
# the broker is the test's Redis DB.
TEST_BROKER = os.environ.get("ORDERLY_TEST_BROKER", "redis")
if TEST_BROKER not in ("redis", "rabbitmq"):
    raise RuntimeError(f"ORDERLY_TEST_BROKER must be redis or rabbitmq, not {TEST_BROKER!r}")
TEST_VHOST: RabbitVhost | None = None
if TEST_BROKER == "rabbitmq":
    TEST_VHOST = RabbitVhost(
        f"orderly-test-{_RUN}-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}",
        os.environ.get("ORDERLY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672"),
    ).create()
    os.environ["ORDERLY_BROKER_URL"] = TEST_VHOST.url
# The processes the tests start import handler modules of the checkout (tooling, tests).
os.environ.update(checkout_env(os.environ))

import redis  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from sqlalchemy import Engine, create_engine, text  # noqa: E402

from orderly.worker import configuration  # noqa: E402
from orderly.worker.db import schema  # noqa: E402
from orderly.worker.messages.intake import Intake  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from orderly.worker.settings import get_settings  # noqa: E402
from orderly.worker.totals import TALLY  # noqa: E402
from tests import kinds  # noqa: E402
from tests.helpers import OrderlyCli, api_key  # noqa: E402
from tests.push_recorder import Recorder  # noqa: E402
from tests.stack import Stack  # noqa: E402
from tooling.processes import ProcessGroup  # noqa: E402
from tooling.servers import PgBouncer, PostgresServer, RedisServer, ServerUnavailable  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# The fixtures orderly offers handler authors (tests/test_handler_testing.py uses them).
pytest_plugins = ["orderly.worker.pytest_plugin"]
TABLES = (
    "report_watermark",
    "response",
    "request",
    "external_call",
    "message",
    "source_system",
    "node",
    "configuration",
    "channel",
    "queue_message",
    "log_exception",
    "published_messages",
    "delivery",
    "event",
    "subscription",
    "publisher",
    "event_type_version",
    "event_type",
    "room",
    "api_key",
    "channel_ack_secret",
    "schedule",
    "funnel_limit",
    "signing_secret",
    "metric_total",
)
EMPTYING: dict[str, str] = {}  # the test database's name -> emptying(it)


def _unavailable(what: str, exc: Exception) -> NoReturn:
    message = f"{what} is not reachable: {exc}"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def pg_engine() -> Iterator[Engine]:
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{TEST_DB}"'))
    except Exception as exc:
        _unavailable("PostgreSQL", exc)
    schema.upgrade(TEST_DB_URL)
    engine = create_engine(TEST_DB_URL)
    EMPTYING[engine.url.database or ""] = emptying(engine)
    yield engine
    TALLY.detach()
    engine.dispose()
    get_runtime().engine.dispose()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{TEST_DB}" WITH (FORCE)'))
    admin.dispose()


def emptying(engine: Engine) -> str:
    """SQL that empties TABLES as ``TRUNCATE ... RESTART IDENTITY`` would, in a few ms: a
    DELETE per table, referencing tables before the tables they reference, then each owned
    sequence back to its start. (A TRUNCATE makes new files for every table and index and
    syncs them at commit: a tenth of a second to half a second per test on this machine.)"""
    with engine.connect() as conn:
        edges = conn.execute(
            text(
                "SELECT conrelid::regclass::text, confrelid::regclass::text FROM pg_constraint"
                " WHERE contype = 'f' AND conrelid <> confrelid"
            )
        ).all()
    graph: dict[str, set[str]] = {t: set() for t in TABLES}
    for child, parent in edges:
        if child not in graph or parent not in graph:
            raise RuntimeError(f"{child} -> {parent}: a table the tests do not empty")
        graph[parent].add(child)  # a parent is emptied after its children
    order = list(TopologicalSorter(graph).static_order())
    restart = (
        "SELECT setval(q.seqrelid::regclass, q.seqstart, false) FROM pg_sequence q"
        " JOIN pg_depend d ON d.objid = q.seqrelid AND d.deptype IN ('a', 'i')"
        f" WHERE d.refobjid::regclass::text IN ({', '.join(repr(t) for t in TABLES)})"
    )
    return "; ".join([*(f"DELETE FROM {t}" for t in order), restart])


@pytest.fixture
def db(pg_engine: Engine) -> Engine:
    """The test database, emptied, with configuration defaults; a fresh runtime per test.

    An app an earlier test made in this process flushes its metric increments no more.
    """
    TALLY.detach()
    with pg_engine.begin() as conn:
        conn.execute(text(EMPTYING[pg_engine.url.database or ""]))
    configuration.ensure_defaults(pg_engine)
    get_runtime.cache_clear()
    get_settings.cache_clear()
    return pg_engine


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        client.ping()
    except Exception as exc:
        _unavailable("Redis", exc)
    client.flushdb()
    _empty_broker()
    yield client
    client.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of the test's own, which it may flush, kill and restart."""
    try:
        server = RedisServer()
    except ServerUnavailable as exc:
        _unavailable("redis-server", exc)
    with server:
        yield server


@pytest.fixture
def pg_server() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster of the test's own (initdb), which it may stop and restart."""
    try:
        server = PostgresServer()
    except ServerUnavailable as exc:
        _unavailable("initdb", exc)
    with server:
        yield server


@pytest.fixture
def pgbouncer(db: Engine) -> Iterator[Callable[[str], PgBouncer]]:
    """Debian's pgbouncer in front of the test database: ``pgbouncer("transaction")``."""
    started: list[PgBouncer] = []

    def start(mode: str) -> PgBouncer:
        try:
            server = PgBouncer(db.url.port or 5432, mode=mode)
        except ServerUnavailable as exc:
            _unavailable("pgbouncer", exc)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.close()


@pytest.fixture
def procs(tmp_path: Path, db: Engine, redis_client: redis.Redis) -> Iterator[ProcessGroup]:
    """Real orderly processes for one test; their logs are printed if the test fails."""
    group = ProcessGroup.create(tmp_path / "logs")
    yield group
    group.stop_all()


def _empty_broker() -> None:
    """On RabbitMQ, orderly's queues are emptied with the test's Redis DB: each test starts
    with no task left by another."""
    if TEST_VHOST is not None:
        from orderly.worker.celery import QUEUES

        TEST_VHOST.purge_queues(QUEUES)


def pytest_unconfigure(config: pytest.Config) -> None:
    if TEST_VHOST is not None:
        TEST_VHOST.remove()


@pytest.fixture
def stack(procs: ProcessGroup, db: Engine) -> Iterator[Stack]:
    """orderly's API, workers and beat, started by the test as it needs them."""
    started = Stack(procs, db)
    yield started
    started.close()


@pytest.fixture
def cli() -> OrderlyCli:
    """The ``orderly`` command, run as a real process with the test's settings."""
    return OrderlyCli()


@pytest.fixture
def queue() -> list[int]:
    """What the ``intake`` fixture enqueued (msg_ids), in order."""
    return []


def make_intake(
    db: Engine, queue: list[int], wake: Callable[[], object] | None = None, group_max: int = 0
) -> Intake:
    """Intake through this process's node, enqueuing into ``queue`` instead of the broker
    (and waking through ``wake``, when given; ``group_max``: submits share commits)."""
    runtime = get_runtime()
    return Intake(
        db,
        node_id=runtime.node_id,
        enqueue=queue.append,
        registry=runtime.registry,
        max_payload_bytes=10_000,
        wake=wake,
        group_max=group_max,
    )


@pytest.fixture
def intake(db: Engine, queue: list[int]) -> Intake:
    """Intake through this process's node, enqueuing into ``queue`` instead of the broker."""
    return make_intake(db, queue)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    """A push endpoint on a free port, shut down after the test."""
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    if report.when == "call" and report.failed:
        group = getattr(item, "funcargs", {}).get("procs")
        if isinstance(group, ProcessGroup):
            for path in sorted(group.log_dir.glob("*.log")):
                tail = path.read_text(errors="replace")[-4000:]
                report.sections.append((f"log {path.name}", tail))
    return report


# --- kinds ----------------------------------------------------------------------------------

KIND = pytest.StashKey[str]()
CALL_FAILED = pytest.StashKey[bool]()
COLLECTED = pytest.StashKey[list[pytest.Item]]()
STORE_PORTS = frozenset(
    {urlsplit(TEST_REDIS_URL).port or 6379, urlsplit(PG_ADMIN_URL).port or 5432}
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # First among the hooks: ``-m`` selects by the markers given here.
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", "")
        marked = [m.name for m in item.iter_markers()]
        found = kinds.kinds_of(module, getattr(item, "fixturenames", ()), marked)
        if not set(marked) & set(kinds.KINDS):
            item.add_marker(found[0])
        item.stash[KIND] = found[0] if len(found) == 1 else "+".join(found)
        if TEST_BROKER != "redis" and item.get_closest_marker("redis_broker"):
            item.add_marker(pytest.mark.skip(reason=f"about the Redis broker; on {TEST_BROKER}"))
    # Before ``-m`` deselects any: tests/test_kinds.py checks every collected test.
    config.stash[COLLECTED] = list(items)
    groups = xdist_groups(items)
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The longest first, so that none is left to run alone at the end (xdist hands out
        # work in this order with ``--no-loadscope-reorder``; every worker sorts alike).
        items.sort(key=lambda item: _longest_first(item, groups.get(item)))


# --- pytest-xdist ---------------------------------------------------------------------------

# Session fixtures every worker may well make for itself (a database per worker).
PER_WORKER_FIXTURES = frozenset({"pg_engine"})
# Modules that must not run beside each other: both start Spark (a JVM each, and
# local[*] takes every core), so they run one after the other on one worker.
SHARED_GROUPS = {"tests.test_report": "spark", "tests.test_spark_cluster": "spark"}


# What takes longest, longest first (minutes each on 2 cores): the API fuzzed, the Spark
# report's group, the wheel built and installed.
LONGEST_FIRST = ("tests.test_fuzz", "spark", "installed")


def _longest_first(item: pytest.Item, group: str | None) -> int:
    module = getattr(getattr(item, "module", None), "__name__", "")
    for rank, name in enumerate(LONGEST_FIRST):
        if name in (module, group):
            return rank
    return len(LONGEST_FIRST)


def xdist_groups(items: list[pytest.Item]) -> dict[pytest.Item, str]:
    """The tests that must run on one xdist worker (``--dist loadgroup``), by group name.

    Tests that share what is built once per module (a module-scoped fixture: a Spark
    session, a Redis cluster, a generated dataset) or once per session (the tests' own
    session fixtures, e.g. the installed wheel) run on the same worker, so that it is built
    once; the modules of :data:`SHARED_GROUPS` join their group. Every other test goes to
    whichever worker is free."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys: dict[pytest.Item, list[str]] = {}
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", "")
        found = [f"group:{SHARED_GROUPS[module]}"] if module in SHARED_GROUPS else []
        info = item._fixtureinfo if isinstance(item, pytest.Function) else None
        for name, defs in info.name2fixturedefs.items() if info else ():
            fixture = defs[-1]
            if fixture.scope in ("module", "package", "class"):
                found.append(f"module:{module}")
            elif (
                fixture.scope == "session"
                and name not in PER_WORKER_FIXTURES
                and getattr(fixture.func, "__module__", "").startswith("tests.")
            ):
                found.append(f"fixture:{name}")
        for key in found[1:]:
            parent[find(key)] = find(found[0])
        if found:
            keys[item] = found
    return {item: find(found[0]).split(":", 1)[1] for item, found in keys.items()}


def collected(config: pytest.Config) -> list[pytest.Item]:
    return config.stash.get(COLLECTED, [])


@pytest.fixture(autouse=True)
def _kind_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test that does what its kind rules out (it would run in the wrong set)."""
    kind = request.node.stash.get(KIND, kinds.E2E)
    broken: list[str] = []

    def refuse(what: str) -> None:
        broken.append(what)
        raise AssertionError(f"a {kind} test may not {what}: see tests/kinds.py")

    if kind != kinds.E2E:

        def no_process(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
            refuse(f"start a process ({args!r})")

        monkeypatch.setattr(subprocess.Popen, "_execute_child", no_process)
    if kind == kinds.UNIT:
        real_connect = socket.socket.connect

        def connect(self: socket.socket, address: Any) -> None:
            if isinstance(address, tuple) and address[1] in STORE_PORTS:
                refuse(f"connect to {address[0]}:{address[1]} (PostgreSQL or Redis)")
            real_connect(self, address)

        def no_postgres(*args: Any, **kwargs: Any) -> None:
            refuse("connect to PostgreSQL")

        monkeypatch.setattr(socket.socket, "connect", connect)
        monkeypatch.setattr("psycopg2.connect", no_postgres)
    yield
    if broken and not request.node.stash.get(CALL_FAILED, False):
        # The code under test caught the error and went on: the test must fail all the same.
        pytest.fail(f"a {kind} test may not {broken[0]}: see tests/kinds.py", pytrace=False)


@pytest.fixture
def client(db: Engine, redis_client: redis.Redis) -> Iterator[TestClient]:
    """orderly's API in this process (its lifespan run), on the test's database and Redis."""
    from orderly.api.http import create_app

    with TestClient(create_app()) as c:
        c.headers["Authorization"] = f"Bearer {api_key(db)}"
        yield c
