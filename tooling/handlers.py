"""Handlers used by the main job, the demo and the benchmarks.

``customer``/``order``/``billing`` fail now and then, deterministically per message and try
(so a run is reproducible); ``bench.noop`` does nothing; ``test.*`` handlers are driven by the
payload and serve the end-to-end tests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time
from typing import Any

from orderly.worker.core.errors import HandlerError
from orderly.worker.core.limits import TimeLimitExceeded
from orderly.worker.handlers import Handler, MessageContext, registry
from orderly.worker.pubsub import Claimed, consumers

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


@registry.register("test", "call")
def call(ctx: MessageContext) -> None:
    """POSTs the payload's ``body`` to its ``url`` through ``ctx.post`` (an external call)."""
    spec = json.loads(ctx.payload or "{}")
    ctx.post(spec["url"], spec.get("body", {}))


@registry.register("test", "say")
def say(ctx: MessageContext) -> None:
    """Logs its payload (the tests of the log formats read it)."""
    log.info("saying %s", ctx.payload)


@registry.register("test", "crash")
def crash(ctx: MessageContext) -> None:
    """Raises an unexpected exception (not a HandlerError)."""
    raise RuntimeError("handler blew up")


@registry.register("test", "poison")
def poison(ctx: MessageContext) -> None:
    """Kills the process running it, as a segfault or the OOM killer would (a poison message)."""
    os.kill(os.getpid(), signal.SIGKILL)


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


@consumers.register("test.poison")
def poison_consumer(event: Claimed) -> None:
    """Kills the process delivering it (a poison event), unless the payload says otherwise
    (``{"harmless": true}``)."""
    if not (isinstance(event.payload, dict) and event.payload.get("harmless")):
        os.kill(os.getpid(), signal.SIGKILL)


@consumers.register("test.record")
def record(event: Claimed) -> None:
    """Records what it processed in Redis (``orderly:test:processed``), so tests can tell."""
    from orderly.worker.core.clients import redis_client
    from orderly.worker.settings import get_settings

    client = redis_client(get_settings().redis_url)
    client.rpush("orderly:test:processed", event.correlation_id)
    client.close()


# --- funnels, external calls, children and responses (tests and the funnel benchmark) -------


@registry.register("bench", "stamp")
def stamp(ctx: MessageContext) -> None:
    """Does nothing but keep when it started and ended (custom_data ``start,end``, epoch s)."""
    started = time.time()
    ctx.custom_data = f"{started:.6f},{time.time():.6f}"


_latency: Any = None


@registry.register("bench", "latency")
def latency(ctx: MessageContext) -> None:
    """Records how long after its send it started (benchmarks/light_load.py): the payload's
    ``sent_at`` (epoch s), one RPUSH to the peers' Redis, as their ``stamp`` tasks do."""
    global _latency
    from benchmarks.peer_apps import REDIS_URL, started

    if _latency is None:
        import redis

        _latency = redis.Redis.from_url(REDIS_URL)
    payload = json.loads(ctx.payload)
    started(_latency, float(payload["sent_at"]))
    if "key" in payload:
        from benchmarks.peer_apps import ORDER_KEY

        _latency.rpush(ORDER_KEY + payload["key"], payload["n"])


def _redis_list(key: str, value: str) -> None:
    from orderly.worker.core.clients import redis_client
    from orderly.worker.settings import get_settings

    client = redis_client(get_settings().redis_url)
    client.rpush(key, value)
    client.close()


@registry.register("test", "ordered")
def ordered(ctx: MessageContext) -> None:
    """Records ``funnel:correlation_id`` in ``orderly:test:order`` when it runs, after an
    optional ``{"sleep": s}``; ``{"fail": true}`` fails it for good (FAILED at once with
    countPartlyFailsBeforeFailed 0)."""
    spec = json.loads(ctx.payload or "{}")
    time.sleep(float(spec.get("sleep", 0)))
    _redis_list("orderly:test:order", f"{ctx.funnel_value}:{ctx.correlation_id}")
    if spec.get("fail"):
        raise HandlerError("E_TOLD", "told to fail")


@registry.register("test", "extcall")
def call_external(ctx: MessageContext) -> None:
    """``{"key": k, "sleep": s}``: the external call ``test.op`` on custom key ``k``; the call
    records ``correlation_id`` in ``orderly:test:calls``; custom_data says what happened."""
    from orderly.worker.messages.extcall import CallKey

    spec = json.loads(ctx.payload or "{}")

    def call() -> str:
        time.sleep(float(spec.get("sleep", 0)))
        _redis_list("orderly:test:calls", ctx.correlation_id)
        return "done"

    result = ctx.external_call("test.op", CallKey.custom(str(spec["key"])), call)
    ctx.custom_data = "CALLED" if result.called else str(result.skipped)


@registry.register("test", "split")
def split(ctx: MessageContext) -> None:
    """``{"children": [{"operation": "script"|"split", "payload": {...}, "soft": bool,
    "funnel_value": f}], "wait": correlation_id}``."""
    spec = json.loads(ctx.payload or "{}")
    for child in spec.get("children", []):
        ctx.add_child(
            "test",
            child.get("operation", "script"),
            child.get("payload", {}),
            soft=bool(child.get("soft", False)),
            funnel_value=child.get("funnel_value"),
        )
    if spec.get("wait"):
        ctx.wait_for_response(spec["wait"])


@registry.register("test", "wait")
def wait(ctx: MessageContext) -> None:
    """Parks until a response to ``{"correlation_id": c, "timeout_s": t}`` comes; then keeps
    its payload in custom_data (a failed response fails the message)."""
    spec = json.loads(ctx.payload or "{}")
    if ctx.response is None:
        ctx.wait_for_response(spec.get("correlation_id"), spec.get("timeout_s"))
        return
    if ctx.response.failed:
        raise HandlerError("E_REMOTE", ctx.response.reason or "the response reports a failure")
    ctx.custom_data = ctx.response.envelope


# --- time limits -------------------------------------------------------------------------------


@registry.register("test", "limited")
def limited(ctx: MessageContext) -> None:
    """``{"sleep": s, "key": k}``: records ``start:<pid>`` in the Redis list ``k`` (default
    ``orderly:test:limited``), sleeps ``s`` seconds, records ``end:<pid>``; stopped by its time
    limit meanwhile, it records ``stopped:<pid>`` and lets the stop go on."""
    spec = json.loads(ctx.payload or "{}")
    key = str(spec.get("key", "orderly:test:limited"))
    _redis_list(key, f"start:{os.getpid()}")
    try:
        time.sleep(float(spec.get("sleep", 0)))
    except TimeLimitExceeded:
        _redis_list(key, f"stopped:{os.getpid()}")
        raise
    _redis_list(key, f"end:{os.getpid()}")


@registry.register("test", "stubborn")
def stubborn(ctx: MessageContext) -> None:
    """Like ``test.limited``, but swallows its time limit's exception (``ignored:<pid>``) and
    goes on sleeping as long again: only the hard limit stops it."""
    spec = json.loads(ctx.payload or "{}")
    key = str(spec.get("key", "orderly:test:limited"))
    seconds = float(spec.get("sleep", 0))
    _redis_list(key, f"start:{os.getpid()}")
    try:
        time.sleep(seconds)
    except TimeLimitExceeded:
        _redis_list(key, f"ignored:{os.getpid()}")
        time.sleep(seconds)
    _redis_list(key, f"end:{os.getpid()}")
