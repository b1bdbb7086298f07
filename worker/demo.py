"""Handlers used by the main job, the demo and the benchmarks.

``customer``/``order``/``billing`` fail now and then, deterministically per message and try
(so a run is reproducible); ``bench.noop`` does nothing; ``test.*`` handlers are driven by the
payload and serve the end-to-end tests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

from worker.errors import HandlerError
from worker.handlers import Handler, MessageContext, registry
from worker.pubsub import Claimed, consumers

log = logging.getLogger(__name__)


def _unlucky(ctx: MessageContext, percent: int) -> bool:
    digest = hashlib.sha1(f"{ctx.correlation_id}:{ctx.failed_count}".encode()).digest()
    return digest[0] * 100 // 256 < percent


def _flaky(percent: int, code: str) -> Handler:
    def handle(ctx: MessageContext) -> None:
        if _unlucky(ctx, percent):
            raise HandlerError(
                code, f"{ctx.service}.{ctx.operation} refused try {ctx.failed_count}"
            )

    return handle


for _service, _operation, _percent in (
    ("customer", "createCustomer", 10),
    ("customer", "updateCustomer", 20),
    ("order", "placeOrder", 15),
    ("billing", "chargeInvoice", 30),
):
    registry.add(_service, _operation, _flaky(_percent, f"E_{_service.upper()}"))


@registry.register("bench", "noop")
def noop(ctx: MessageContext) -> None:
    """Does nothing: measures orderly's own cost per message."""


@registry.register("test", "script")
def scripted(ctx: MessageContext) -> None:
    """Behaviour chosen by the payload: ``{"fail_times": n, "sleep": s, "code": "E_X"}``.

    Fails the first ``fail_times`` tries, sleeps ``sleep`` seconds first, and appends the try
    number to custom_data so tests can see every try.
    """
    spec = json.loads(ctx.payload or "{}")
    ctx.custom_data = f"{ctx.custom_data or ''}{ctx.failed_count};"
    time.sleep(float(spec.get("sleep", 0)))
    if ctx.failed_count < int(spec.get("fail_times", 0)):
        raise HandlerError(spec.get("code", "E_SCRIPTED"), f"scripted failure {ctx.failed_count}")


@registry.register("test", "crash")
def crash(ctx: MessageContext) -> None:
    """Raises an unexpected exception (not a HandlerError)."""
    raise RuntimeError("handler blew up")


# --- consumers chosen by routing key (publish/subscribe) ------------------------------------


@consumers.register("echo")
def echo(event: Claimed) -> None:
    """The broker seed's example consumer: logs the message it was given."""
    log.info("echo %s: %s", event.routing_key, event.payload)


@consumers.register("test.fail")
def fail_when_told(event: Claimed) -> None:
    """Fails while the payload asks it to (``{"fail": true}``); for the tests."""
    if isinstance(event.payload, dict) and event.payload.get("fail"):
        raise RuntimeError("told to fail")


@consumers.register("test.record")
def record(event: Claimed) -> None:
    """Records what it processed in Redis (``orderly:test:processed``), so tests can tell."""
    import redis

    from worker.settings import get_settings

    client = redis.Redis.from_url(get_settings().redis_url)
    client.rpush("orderly:test:processed", event.correlation_id)
    client.close()
