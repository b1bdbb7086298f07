"""For handler authors: run one handler on a message against a real store, in a test, with no
worker and no broker.

    from orderly.worker.testing import run_handler

    def test_ship(orderly_engine):                       # the pytest fixture (below)
        done = run_handler(orderly_engine, {...message...}, handler=ship)
        assert done.state == "OK" and done.custom_data == "shipped"

:func:`run_handler` stores the message as the API would (the same validation), claims and
processes it in this process exactly as a worker does (the handler's outcome, failures,
custom data, children, a wait for a response), and returns the stored row's outcome. The
children it spawns are stored, not processed. The pytest plugin ``orderly.worker.pytest_plugin``
(``pytest_plugins = ["orderly.worker.pytest_plugin"]`` in a conftest) gives ``orderly_engine``: the
engine of ``ORDERLY_DATABASE_URL``, migrated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from orderly.worker import nodes
from orderly.worker.configuration import ConfigReader
from orderly.worker.core.http import OutboundHttp
from orderly.worker.db.queries import sql
from orderly.worker.messages.batches import process_message
from orderly.worker.messages.handlers import Handler, HandlerRegistry, registry
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import Processor

# The node a test's messages are stored and processed under.
TEST_NODE = "handler-test"


@dataclass(frozen=True)
class HandlerRun:
    msg_id: int
    state: str
    outcome: str
    failed_count: int
    failed_error_code: str | None
    failed_desc: str | None
    custom_data: str | None
    children: tuple[int, ...]


def run_handler(
    engine: Engine,
    message: Any,
    *,
    handler: Handler | None = None,
    handlers: HandlerRegistry | None = None,
    max_payload_bytes: int = 1_048_576,
) -> HandlerRun:
    """Store ``message`` (a dict or a ``MessageIn``) and process it once with ``handler``
    (registered for its service and operation), or with ``handlers`` (default: the handlers
    registered in this process)."""
    data = message.model_dump(mode="json") if hasattr(message, "model_dump") else dict(message)
    chosen = handlers if handlers is not None else registry
    if handler is not None:
        chosen = HandlerRegistry()
        chosen.add(str(data.get("service")), str(data.get("operation")), handler)
    node_id = nodes.register_node(engine, TEST_NODE)
    stored: list[int] = []
    intake = Intake(
        engine,
        node_id=node_id,
        enqueue=stored.append,
        registry=chosen,
        max_payload_bytes=max_payload_bytes,
    )
    msg_id = intake.submit(data).msg_id
    processor = Processor(
        engine,
        node_id=node_id,
        registry=chosen,
        config=ConfigReader(engine, ttl_seconds=0),
        http=OutboundHttp(),
    )
    result = process_message(processor, msg_id)
    with engine.connect() as conn:
        row = conn.execute(sql("message_outcome"), {"id": msg_id}).one()
    return HandlerRun(
        msg_id=msg_id,
        state=row.state,
        outcome=result.outcome.value,
        failed_count=int(row.failed_count),
        failed_error_code=row.failed_error_code,
        failed_desc=row.failed_desc,
        custom_data=row.custom_data,
        children=tuple(result.spawned),
    )
