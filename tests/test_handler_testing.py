"""orderly.worker.testing.run_handler: a handler author's test runs one handler against the
real store, with no worker and no broker, and sees what a worker would have stored."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from orderly.worker.core.errors import HandlerError, InvalidMessage
from orderly.worker.handlers import HandlerRegistry, MessageContext
from orderly.worker.testing import run_handler
from tests.helpers import message


def ship(ctx: MessageContext) -> None:
    if ctx.payload == "broken":
        raise HandlerError("E_SHIP", "the parcel is broken")
    ctx.custom_data = f"shipped {ctx.payload}"


def test_a_handler_runs_on_the_store_and_its_outcome_is_stored(
    db: Engine, orderly_engine: Engine
) -> None:
    done = run_handler(
        orderly_engine, message(1, service="shop", operation="ship", payload="box"), handler=ship
    )
    assert (done.state, done.outcome, done.custom_data) == ("OK", "OK", "shipped box")
    failed = run_handler(
        orderly_engine, message(2, service="shop", operation="ship", payload="broken"), handler=ship
    )
    assert failed.state == "PARTLY_FAILED" and failed.failed_error_code == "E_SHIP"
    assert failed.failed_count == 1 and "broken" in (failed.failed_desc or "")


def test_a_message_without_a_handler_is_refused_as_the_api_would(
    orderly_engine: Engine, db: Engine
) -> None:
    with pytest.raises(InvalidMessage):
        run_handler(
            orderly_engine, message(3, service="shop", operation="ship"), handlers=HandlerRegistry()
        )
