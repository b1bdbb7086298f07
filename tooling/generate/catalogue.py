"""The catalogue: operations, rooms, subscriptions, distributions and the clock."""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from statistics import NormalDist
from typing import Any, Generic, TypeVar, cast

from orderly.worker.messages.processing import ERROR_HANDLER
from orderly.worker.messages.timeouts import TIMEOUT_CODE
from tooling.generate.columns import HOUR, SECOND

T = TypeVar("T")


@dataclass(frozen=True)
class _Call:
    """An external call a handler makes; ``keyed_by`` is the CallKey kind (msg or entity)."""

    operation: str
    share: float
    keyed_by: str
    uri: str
    logged: float  # share of calls whose HTTP exchanges are logged in request/response


@dataclass(frozen=True)
class _Op:
    service: str
    operation: str
    weight: float
    entity: str | None
    prefix: str  # object ids: prefix + number
    sources: tuple[str, ...]
    codes: tuple[tuple[str, str], ...]  # the handler's own failures: (code, description)
    call: _Call | None = None
    funnel: float = 0.0  # share of messages with a funnel (the object id)
    guaranteed: float = 0.0  # share of the funnel messages in guaranteed order
    waits: float = 0.0  # share that waits for an asynchronous response


_OPS = (
    _Op(
        "crm",
        "createCustomer",
        10,
        "customer",
        "C",
        ("eshop", "crm-portal", "mobile-app"),
        (
            ("E_CRM_DUPLICATE", "customer already exists with the same e-mail"),
            ("E_CRM_VALIDATION", "field birthDate: not a valid date"),
        ),
        _Call("erp.syncCustomer", 0.6, "entity", "https://erp.example.com/api/customers", 0.3),
    ),
    _Op(
        "crm",
        "updateCustomer",
        14,
        "customer",
        "C",
        ("eshop", "crm-portal", "mobile-app", "partner-api"),
        (("E_CRM_UNAVAILABLE", "crm: HTTP 503 Service Unavailable"),),
        _Call("erp.syncCustomer", 0.4, "entity", "https://erp.example.com/api/customers", 0.3),
        funnel=0.5,
        guaranteed=0.6,
    ),
    _Op(
        "order",
        "placeOrder",
        10,
        "order",
        "O",
        ("eshop", "mobile-app", "pos", "partner-api"),
        (("E_ORDER_STOCK", "an order line refers to a discontinued article"),),
    ),
    _Op(
        "order",
        "updateOrder",
        6,
        "order",
        "O",
        ("eshop", "crm-portal", "pos"),
        (("E_ORDER_STATE", "order is already closed"),),
        funnel=0.7,
        guaranteed=0.9,
    ),
    _Op(
        "billing",
        "charge",
        12,
        "invoice",
        "INV",
        ("eshop", "mobile-app", "pos", "erp"),
        (
            ("E_PAYMENT_DECLINED", "card declined by issuer (do_not_honor)"),
            ("E_BILLING", "billing.charge refused by the payment gateway"),
        ),
        _Call("psp.authorize", 0.9, "msg", "https://psp.example.com/v2/authorizations", 0.4),
        waits=0.15,
    ),
    _Op(
        "billing",
        "refund",
        3,
        "invoice",
        "INV",
        ("crm-portal", "erp"),
        (("E_PAYMENT_DECLINED", "refund refused: original charge not settled"),),
        _Call("psp.refund", 0.9, "msg", "https://psp.example.com/v2/refunds", 0.4),
    ),
    _Op(
        "billing",
        "issueInvoice",
        6,
        "invoice",
        "INV",
        ("erp",),
        (("E_INVOICE_NUMBERING", "invoice number range exhausted for the period"),),
    ),
    _Op(
        "shipping",
        "dispatch",
        8,
        "shipment",
        "SH",
        ("erp", "warehouse"),
        (
            ("E_CARRIER_REJECTED", "carrier rejected the parcel: address not deliverable"),
            ("E_CARRIER_UNAVAILABLE", "carrier API: HTTP 502 Bad Gateway"),
        ),
        _Call(
            "carrier.createShipment", 0.8, "entity", "https://api.carrier.example/shipments", 0.4
        ),
        waits=0.25,
    ),
    _Op(
        "shipping",
        "cancelShipment",
        1.5,
        "shipment",
        "SH",
        ("erp", "crm-portal"),
        (("E_CARRIER_REJECTED", "shipment already handed over to the carrier"),),
    ),
    _Op(
        "inventory",
        "reserveStock",
        7,
        "sku",
        "SKU-",
        ("eshop", "pos", "warehouse"),
        (("E_OUT_OF_STOCK", "requested quantity exceeds the available stock"),),
        funnel=0.6,
    ),
    _Op(
        "inventory",
        "releaseStock",
        2,
        "sku",
        "SKU-",
        ("eshop", "warehouse"),
        (("E_STOCK_LOCKED", "stock row locked by a running inventory count"),),
        funnel=0.6,
    ),
    _Op(
        "notification",
        "sendEmail",
        9,
        None,
        "",
        ("crm-portal", "eshop", "erp"),
        (("E_MAIL_REJECTED", "550 5.1.1 mailbox unavailable"),),
        _Call("mail.send", 0.5, "msg", "https://mail.example.com/v3/send", 0.2),
    ),
    _Op(
        "notification",
        "sendSms",
        3,
        None,
        "",
        ("crm-portal", "mobile-app"),
        (("E_SMS_GATEWAY", "sms gateway: HTTP 429 Too Many Requests"),),
        _Call("sms.send", 0.5, "msg", "https://sms.example.com/messages", 0.2),
    ),
)
_OP = {(op.service, op.operation): op for op in _OPS}
# order.placeOrder splits into children: (service, operation, binding), the first n of them.
_CHILDREN = (
    ("billing", "charge", "HARD"),
    ("inventory", "reserveStock", "HARD"),
    ("shipping", "dispatch", "HARD"),
    ("notification", "sendEmail", "SOFT"),
)
_SPLIT_SHARE = 0.45  # of order.placeOrder messages
# Failures any handler can meet, next to its own codes.
_GENERIC_FAILURES = (
    (ERROR_HANDLER, "ConnectionError: connection reset by peer"),
    (ERROR_HANDLER, "KeyError: 'lines'"),
    (TIMEOUT_CODE, "no worker finished it within 30000 ms (timeout 1 of 3); retried"),
)
# What a conversation response's failures say (worker/conversations.py).
AWAITED_DESC = "ReadTimeout (5 retries spent)"
EXPIRED_DESC = "AWAITED_MESSAGE_TTL spent before delivery"
TIMEOUT_FINAL = "no worker finished it within 30000 ms (timeout 3 of 3); no retries left"
# Sources that are told final states (their confirmation_url was set when these were written).
_CONFIRMED_SOURCES = frozenset({"partner-api", "pos"})
_SOAP_SOURCES = frozenset({"erp"})
_ORIGINS = (("shop-web", 5.0), ("shop-app", 3.0), ("partner-gw", 1.0))
_NODES = (
    ("gen-worker-1", 34.0),
    ("gen-worker-2", 26.0),
    ("gen-worker-3", 20.0),
    ("gen-worker-4", 12.0),
    ("gen-worker-5", 8.0),
)
_OPERATORS = ("ops-anna", "ops-martin", "support-bot")
_CANCEL_NOTES = (
    "customer withdrew the order",
    "duplicate of a newer request",
    "data fixed by hand",
)

# Daily rhythm (UTC hours) and the weekend dip of message traffic.
_HOURLY = (
    0.15, 0.1, 0.08, 0.08, 0.1, 0.2, 0.4, 0.8, 1.3, 1.6, 1.7, 1.6,
    1.4, 1.5, 1.6, 1.5, 1.3, 1.1, 0.9, 0.7, 0.55, 0.45, 0.3, 0.2,
)  # fmt: skip
_WEEKEND = 0.45


@dataclass(frozen=True)
class _RoomSpec:
    name: str
    expiration_ms: int | None
    delay_ms: int
    multiplier: float
    attempts: int
    weight: float
    event_types: tuple[str, ...]
    id_field: str
    prefix: str


@dataclass(frozen=True)
class _SubSpec:
    room: str
    name: str
    kind: str
    event_type: str | None
    pattern: str | None
    attempts: int | None = None
    order_key: str | None = None


_ROOMS = (
    _RoomSpec(
        "orders",
        86_400_000,
        1000,
        2.0,
        5,
        5,
        ("order.created", "order.paid", "order.shipped", "order.cancelled"),
        "orderId",
        "O",
    ),
    _RoomSpec(
        "customers",
        None,
        500,
        1.5,
        3,
        3,
        ("customer.created", "customer.updated"),
        "customerId",
        "C",
    ),
    _RoomSpec(
        "payments",
        120_000,
        2000,
        3.0,
        4,
        2,
        ("payment.authorized", "payment.failed", "payment.refunded"),
        "invoice",
        "INV",
    ),
)
_SUBSCRIPTIONS = (
    _SubSpec("orders", "warehouse-push", "PUSH", None, "order.#"),
    _SubSpec("orders", "analytics-pull", "PULL", None, None),
    _SubSpec("orders", "loyalty-handler", "HANDLER", "order.paid", None),
    _SubSpec("customers", "crm-mirror-push", "PUSH", None, "customer.*"),
    _SubSpec("customers", "mailing-handler", "HANDLER", "customer.created", None),
    _SubSpec("payments", "ledger-handler", "HANDLER", None, "payment.#", order_key="invoice"),
    _SubSpec("payments", "fraud-push", "PUSH", "payment.authorized", None, attempts=2),
)
_PUSH_ERRORS = (
    "HTTP 503: Service Unavailable",
    "ReadTimeout",
    "ConnectError: [Errno 111] Connection refused",
    "HTTP 500: internal error",
)
_HANDLER_ERRORS = ("ValueError: unknown tier", "OperationalError: deadlock detected")


def _table(weights: Sequence[tuple[T, float]], size: int = 1024) -> list[T]:
    """A lookup list for picking by ``table[rng.getrandbits(10)]`` (cheaper than choices)."""
    total = sum(w for _, w in weights)
    out: list[T] = []
    acc = 0.0
    for value, weight in weights:
        acc += weight
        out.extend([value] * (round(acc / total * size) - len(out)))
    return out


def _clock() -> Callable[[int], str]:
    """Timestamps (integer ms since the epoch) as PostgreSQL text: the hour's prefix is cached
    and the rest looked up, several times cheaper than formatting a datetime."""
    hours: dict[int, str] = {}
    seconds: dict[int, str] = {}
    minutes = [f"{m:02d}:{s:02d}." for m in range(60) for s in range(60)]
    millis = [f"{m:03d}+00" for m in range(1000)]

    def stamp(ms: int) -> str:
        second, milli = divmod(ms, SECOND)
        text = seconds.get(second)
        if text is None:
            if len(seconds) > 100_000:
                seconds.clear()  # rows are made in time order: old seconds do not come back
            hour, rest = divmod(second, 3600)
            prefix = hours.get(hour)
            if prefix is None:
                prefix = datetime.fromtimestamp(hour * 3600, UTC).strftime("%Y-%m-%d %H:")
                hours[hour] = prefix
            text = seconds[second] = prefix + minutes[rest]
        return text + millis[milli]

    return stamp


def _iso(ms: int) -> str:
    """The form jsonb_build_object gives a timestamptz."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


# Quantiles of the standard normal: lognormal draws become a table lookup.
_NORMAL = [NormalDist().inv_cdf((i + 0.5) / 4096) for i in range(4096)]


class _Ahead(Generic[T]):
    """Runs an iterator in a thread a few items ahead of its consumer, so that Python makes
    the next rows while the server ingests the previous ones (psycopg2 releases the GIL
    while it sends)."""

    def __init__(self, items: Iterator[T], depth: int = 4) -> None:
        # (True, item), (False, None) at the end, or (False, exception) from the producer
        self._queue: queue.Queue[tuple[bool, Any]] = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(items,), daemon=True)
        self._thread.start()

    def _put(self, item: tuple[bool, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, items: Iterator[T]) -> None:
        try:
            for item in items:
                if not self._put((True, item)):
                    return
            self._put((False, None))
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put((False, exc))

    def __iter__(self) -> Iterator[T]:
        while True:
            more, item = self._queue.get()
            if more:
                yield cast(T, item)
            elif item is None:
                return
            else:
                raise item

    def close(self) -> None:
        """Stop the producer (after a failed COPY it would wait on a full queue forever)."""
        self._stop.set()
        self._thread.join()


def _timeline(rng: random.Random, count: int, start: int, end: int) -> Iterator[int]:
    """``count`` moments (ms) in ascending order in [start, end), denser in working hours.

    Ascending uniforms are drawn one at a time (the largest of k uniforms is U^(1/k)), and
    mapped through the hour buckets' cumulative weights, so nothing has to be sorted.
    """
    bounds = list(range(start - start % HOUR, end, HOUR))
    cum: list[float] = []
    total = 0.0
    for lo in bounds:
        moment = datetime.fromtimestamp(lo / 1000, UTC)
        rate = _HOURLY[moment.hour] * (_WEEKEND if moment.weekday() >= 5 else 1.0)
        total += rate * (min(lo + HOUR, end) - max(lo, start))
        cum.append(total)
    last = len(cum) - 1
    v = 1.0
    b = 0
    for k in range(count, 0, -1):
        v *= rng.random() ** (1.0 / k)
        target = (1.0 - v) * total
        while b < last and cum[b] <= target:
            b += 1
        below = cum[b - 1] if b else 0.0
        lo, hi = max(bounds[b], start), min(bounds[b] + HOUR, end)
        share = (target - below) / (cum[b] - below) if cum[b] > below else 0.0
        yield min(lo + int(share * (hi - lo)), end - 1)
