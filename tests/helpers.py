"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from orderly.models import Message
from orderly.models.keys import BridgeKeys, RateKeys
from orderly.worker import keys
from orderly.worker.core.addresses import AddressPolicy
from orderly.worker.core.group_commit import GroupCommit
from orderly.worker.core.http import HttpOptions, OutboundHttp
from orderly.worker.handlers import HandlerRegistry
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import Processor
from tooling.processes import BIN

BASE_TS = datetime(2026, 1, 1, tzinfo=UTC)

# The test servers listen on loopback, which the outbound address policy refuses unless
# allowed: allowed here explicitly, as ORDERLY_OUTBOUND_ALLOW does for the tests' processes.
LOOPBACK = AddressPolicy.parse("127.0.0.1")


def local_http(**options: Any) -> OutboundHttp:
    """The outbound client, allowed to reach the tests' servers on 127.0.0.1."""
    return OutboundHttp(HttpOptions(policy=LOOPBACK, **options))


def message(n: int, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "service": "test",
        "operation": "script",
        "correlation_id": f"corr-{n}",
        "source_system": "crm",
        "msg_timestamp": (BASE_TS + timedelta(seconds=n)).isoformat(),
        "payload": "{}",
    }
    body.update(overrides)
    return body


def count_messages(engine: Engine) -> int:
    with Session(engine) as session:
        return int(session.scalar(select(func.count()).select_from(Message)) or 0)


def row(engine: Engine, msg_id: int) -> Message:
    with Session(engine) as session:
        found = session.get(Message, msg_id)
        assert found is not None
        return found


def states(engine: Engine) -> dict[int, str]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT msg_id, state FROM message ORDER BY msg_id"))
        return {r.msg_id: r.state for r in rows}


def processor(engine: Engine, reg: HandlerRegistry | None = None) -> Processor:
    """A processor on this process's node, reading configuration without a cache."""
    from orderly.worker.configuration import ConfigReader
    from orderly.worker.handlers import registry
    from orderly.worker.runtime import get_runtime

    return Processor(
        engine,
        node_id=get_runtime().node_id,
        registry=registry if reg is None else reg,
        config=ConfigReader(engine, ttl_seconds=0),
        http=local_http(),
    )


def api_key(engine: Engine, *scopes: str, name: str = "tests") -> str:
    """A new API key's token: with ``scopes``, or every scope when none is given."""
    _, token = keys.create_key(engine, {"name": name, "scopes": list(scopes or keys.SCOPES)})
    return token


def processes_with(marker: str) -> list[int]:
    """The pids of the processes whose environment holds ``marker`` (a test's own value)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
    return found


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


def set_config(engine: Engine, **values: str) -> None:
    """Set configuration items by their code with dots written as double underscores."""
    from orderly.worker import configuration

    for key, value in values.items():
        configuration.set_value(engine, key.replace("__", "."), value)


class ManualClock:
    """A clock a test moves itself (worker.core.clock.Clock): waits pass without sleeping."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start
        self.mono = 1_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.mono += seconds

    def advance_ms(self, ms: int) -> None:
        """Move on by exactly ``ms``: the mechanisms then read ``ms()`` more milliseconds."""
        self.mono += ms / 1000
        self.now = (self.ms() + ms) / 1000

    def ms(self) -> int:
        return int(self.now * 1000)


class OrderlyCli:
    """The ``orderly`` command as a real process, with the test's settings in its environment
    (``env`` adds to or overrides them)."""

    path = str(BIN / "orderly")

    def __call__(
        self, *args: str, stdin: str | None = None, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.path, *args],
            capture_output=True,
            text=True,
            input=stdin,
            env={**os.environ, "COLUMNS": "200", **(env or {})},
            timeout=60,
        )


def bridge_ready(client: Any, keys: BridgeKeys | None = None) -> bool:
    """Every shard's Redis marker says "ready" (worker/rebuild.py): a rebuild is done."""
    pipe = client.pipeline(transaction=False)
    for shard in (keys or BridgeKeys()).every_shard:
        pipe.hget(shard.epoch, "state")
    return all(state == b"ready" for state in pipe.execute())


def stored_keys(r: redis.Redis) -> int:
    """Redis keys that hold orderly's objects: all but the rate limits' buckets, which a
    refused request is charged to by design."""
    prefix = f"{RateKeys().prefix}:".encode()
    return sum(1 for key in r.scan_iter(count=1000) if not key.startswith(prefix))


def make_due(engine: Engine, *msg_ids: int) -> None:
    """Let the due time of waiting messages come now (as if their wait had passed)."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE message SET due_at = now() - interval '1 ms' WHERE msg_id = ANY(:ids)"),
            {"ids": list(msg_ids)},
        )


def take_due(engine: Engine, postponed_s: int = 5, wake: Callable[[], object] | None = None) -> int:
    """One turn of the messages' due source (what beat's ticker does): how many became
    claimable; ``wake`` (default: nothing) is the worker wake-up it hands them to."""
    from orderly.worker.core.due import drain
    from orderly.worker.messages.due import due_messages

    return drain(due_messages(engine, wake or (lambda: None), postponed_s), 1000)


def group_writes(
    writer: Intake | GroupCommit[Any, Any], gate: threading.Event | None = None
) -> list[int]:
    """The sizes of the groups ``writer`` (an intake's group commit, or another) writes from
    now on (each recorded as its write starts); with ``gate``, each write waits for it first
    (30 s at most)."""
    sizes: list[int] = []
    group = writer._group if isinstance(writer, Intake) else writer
    assert group is not None
    write = group._write

    def recorded(items: Sequence[object]) -> Sequence[object]:
        sizes.append(len(items))
        if gate is not None:
            gate.wait(30)
        return write(items)  # type: ignore[arg-type]

    group._write = recorded
    return sizes


def queued(queue: str) -> int:
    """Tasks waiting in one of orderly's broker queues: the test's Redis DB, or its RabbitMQ
    virtual host (ORDERLY_TEST_BROKER=rabbitmq), read as ``orderly status`` reads them."""
    from orderly.worker.celery import broker

    return int(broker.figures().queues[queue])


def received_earlier(db: Engine, correlation_id: str, ms: int) -> None:
    """The row of ``correlation_id`` received ``ms`` earlier than it was: PostgreSQL, which a
    script asks when a key is gone, then agrees that a life counted from it ran out."""
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET receive_timestamp = receive_timestamp - :ago"
                " WHERE correlation_id = :c"
            ),
            {"ago": timedelta(milliseconds=ms), "c": correlation_id},
        )
