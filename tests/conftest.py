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
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import pytest

from tooling.processes import checkout_env

# Settings are read from the environment at import time of the app modules: set them first.
_RUN = uuid.uuid4().hex[:8]
PG_ADMIN_URL = os.environ.get(
    "ORDERLY_TEST_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
)
TEST_DB = f"orderly_test_{_RUN}"
TEST_DB_URL = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{TEST_DB}"
TEST_REDIS_URL = os.environ.get("ORDERLY_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
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
os.environ.pop("ORDERLY_BROKER_URL", None)
# The processes the tests start import handler modules of the checkout (tooling, tests).
os.environ.update(checkout_env(os.environ))

import redis  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from sqlalchemy import Engine, create_engine, text  # noqa: E402

from orderly.worker import configuration  # noqa: E402
from orderly.worker.intake import Intake  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from orderly.worker.settings import get_settings  # noqa: E402
from orderly.worker.store import schema  # noqa: E402
from tests import kinds  # noqa: E402
from tests.helpers import OrderlyCli, api_key  # noqa: E402
from tests.push_recorder import Recorder  # noqa: E402
from tests.stack import Stack  # noqa: E402
from tooling.processes import ProcessGroup  # noqa: E402
from tooling.servers import PostgresServer, RedisServer, ServerUnavailable  # noqa: E402

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
)


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
    yield engine
    engine.dispose()
    get_runtime().engine.dispose()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{TEST_DB}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def db(pg_engine: Engine) -> Engine:
    """The test database, emptied, with configuration defaults; a fresh runtime per test."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
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
def procs(tmp_path: Path, db: Engine, redis_client: redis.Redis) -> Iterator[ProcessGroup]:
    """Real orderly processes for one test; their logs are printed if the test fails."""
    group = ProcessGroup.create(tmp_path / "logs")
    yield group
    group.stop_all()


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


def make_intake(db: Engine, queue: list[int], wake: Callable[[], object] | None = None) -> Intake:
    """Intake through this process's node, enqueuing into ``queue`` instead of the broker
    (and waking through ``wake``, when given)."""
    runtime = get_runtime()
    return Intake(
        db,
        node_id=runtime.node_id,
        enqueue=queue.append,
        registry=runtime.registry,
        max_payload_bytes=10_000,
        wake=wake,
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
    # Before ``-m`` deselects any: tests/test_kinds.py checks every collected test.
    config.stash[COLLECTED] = list(items)


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
