"""Confirmations: a message's final state told to its source system over HTTP.

A source system with a ``confirmation_url`` (``source_system`` table) is confirmed every final
state of its messages. The trigger on ``message.state`` records the confirmation as an
external call (operation ``orderly.confirmation``, entity the msg_id) in the same transaction,
due at once; beat's ticker moves due confirmations to the broker (SKIP LOCKED, leased, each
batch under a claim token the task must present), and a task POSTs ``{msg_id,
correlation_id, source_system, state, failed_error_code, failed_desc}`` with
``Idempotency-Key: confirmation:<msg_id>``, logging the exchange in
``request``/``response``. A 2xx makes it OK; a failure FAILED, tried again after
``asynch.confirmation.intervalSec * asynch.confirmation.multiplier ^ n`` (the retry policy);
the ``asynch.confirmation.failedLimit``-th failure FAILED_END (no further tries).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator
from sqlalchemy import Engine

from orderly.worker.configuration import ConfigReader
from orderly.worker.core.addresses import AddressPolicy
from orderly.worker.core.due import PgDueIndex
from orderly.worker.core.errors import ExchangeFailed, InvalidMessage
from orderly.worker.core.http import OutboundHttp, SignedAs
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.lease import ORPHAN_GRACE_S
from orderly.worker.core.retry import (
    MAX_ATTEMPTS,
    MAX_DELAY_MS,
    MAX_MULTIPLIER,
    RetryPolicy,
    retry_headers,
)
from orderly.worker.db.prepared import prepared_connection
from orderly.worker.db.queries import sql
from orderly.worker.messages import extcall

log = logging.getLogger(__name__)

DISPATCH_BATCH = 100


class SourceSystemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    confirmation_url: str | None = None
    # Within the dispatch lease, so a confirmation in flight is not sent again meanwhile.
    timeout_ms: Annotated[StrictInt, Field(ge=1, le=30_000)] = 5000

    @field_validator("confirmation_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")) or len(value) > 500:
            raise ValueError("must be an http:// or https:// URL of at most 500 characters")
        return value


def set_source_system(
    engine: Engine, name: str, data: Any, *, policy: AddressPolicy | None = None
) -> dict[str, Any]:
    """Create or change a source system's confirmation target (a URL the outbound address
    policy allows: ``policy``, by default the settings')."""
    if not 1 <= len(name) <= 100:
        raise InvalidMessage("name", "must be 1 to 100 characters")
    spec = parse_input(SourceSystemIn, data)
    if spec.confirmation_url is not None:
        if policy is None:
            from orderly.worker.settings import get_settings

            policy = get_settings().outbound_policy
        policy.check_url("confirmation_url", spec.confirmation_url)
    with engine.begin() as conn:
        conn.execute(
            sql("source_system_put"),
            {"name": name, "url": spec.confirmation_url, "timeout": spec.timeout_ms},
        )
    return {"name": name, "confirmation_url": spec.confirmation_url, "timeout_ms": spec.timeout_ms}


def list_source_systems(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(sql("source_system_list"))
        return [dict(r._mapping) for r in rows]


def due_confirmations(
    engine: Engine, hand_off: Callable[[list[tuple[int, str]]], None]
) -> PgDueIndex:
    """Confirmations as due work: each due call goes to ``hand_off`` with the claim token it
    was taken under (a task per batch); only that token may settle the try."""
    return PgDueIndex(
        "confirmations",
        engine,
        "confirmation_take",
        "confirmation_release",
        "confirmation_next_due",
        hand_off,
        batch=DISPATCH_BATCH,
    )


def retry_policy(config: ConfigReader) -> RetryPolicy:
    """``failedLimit`` tries in all: the n-th failure is retried after intervalSec *
    multiplier ^ n, the last one is FAILED_END. Values beyond the policy's bounds (a table
    filled before they were checked) are held to them."""
    return RetryPolicy(
        min(config.get_int("asynch.confirmation.intervalSec") * 1000, MAX_DELAY_MS),
        min(max(config.get_float("asynch.confirmation.multiplier"), 1.0), MAX_MULTIPLIER),
        min(config.get_int("asynch.confirmation.failedLimit") - 1, MAX_ATTEMPTS),
    )


def release_orphans(engine: Engine, lost_limit: int) -> tuple[int, int]:
    """Tries whose worker died: due again at once, or FAILED_END at ``lost_limit`` deaths.
    Returns (released, quarantined)."""
    with engine.begin() as conn:
        rows = conn.execute(
            sql("confirmations_release_orphans"),
            {"grace_s": ORPHAN_GRACE_S, "limit": lost_limit, "batch": DISPATCH_BATCH},
        ).all()
    quarantined = sum(1 for r in rows if r.state == "FAILED_END")
    return len(rows) - quarantined, quarantined


def confirm(
    engine: Engine, call_id: int, claim: str, config: ConfigReader, http: OutboundHttp
) -> str:
    """One try of a confirmation under the claim it was taken with; its new state, or
    NOT_DUE when that claim no longer holds it (taken again, settled meanwhile, or being
    tried by a live worker)."""
    # One connection from the start of the try to its outcome: its backend pid, recorded
    # with the try, is this worker's liveness (release_orphans).
    with engine.connect() as conn:
        with conn.begin():
            row = conn.execute(sql("confirmation_start"), {"id": call_id, "claim": claim}).first()
        if row is None:
            return "NOT_DUE"
        state, wait = _try(engine, row, config, http)
        params = {"id": call_id, "claim": claim, "state": state, "wait_ms": wait}
        with conn.begin():
            settled = conn.execute(sql("confirmation_settle"), params).scalar()
    return str(settled or "NOT_DUE")


def _try(engine: Engine, row: Any, config: ConfigReader, http: OutboundHttp) -> tuple[str, int]:
    """POST the confirmation; the try's new state and the wait before the next one."""
    policy = retry_policy(config)
    ok = False  # a source system whose URL was removed meanwhile: a failed try
    if row.confirmation_url is not None:
        body = {
            "msg_id": row.msg_id,
            "correlation_id": row.correlation_id,
            "source_system": row.source_system,
            "state": row.state,
            "failed_error_code": row.failed_error_code,
            "failed_desc": row.failed_desc,
        }
        try:
            with prepared_connection(engine) as prepared:
                extcall.post_logged(
                    prepared,
                    http,
                    row.msg_id,
                    row.confirmation_url,
                    body,
                    res_join_id=f"confirmation:{row.msg_id}:{row.failed_count + 1}",
                    timeout_ms=row.timeout_ms,
                    headers={
                        "Idempotency-Key": f"confirmation:{row.msg_id}",
                        **retry_headers(policy, row.failed_count + 1),
                    },
                    signed_as=SignedAs("source_system", row.source_system, f"cnf_{row.msg_id}"),
                )
            ok = True
        except ExchangeFailed:
            ok = False
        except Exception:
            # Whatever went wrong, this try is over and counted: it must not be made again
            # and again under a lease that never settles.
            log.exception("confirmation of message %s failed", row.msg_id)
            ok = False
    failure = row.failed_count + 1
    if ok:
        return "OK", 0
    if policy.allows(failure):
        return "FAILED", policy.delay(failure)
    return "FAILED_END", 0
