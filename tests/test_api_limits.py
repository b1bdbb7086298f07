"""The API's rate limits (api/http/ratelimit.py) through the real app in this process, on the
real Redis and PostgreSQL, with tight limits set through the settings and a clock the test
moves: per key, per client address, refused credentials per address, the console's sign-ins;
an unknown API key or ACK refused without a PostgreSQL round trip or a wait of its own."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event

from orderly.worker import keys
from orderly.worker.channels import ACK_TOKEN_HEADER, Channel
from orderly.worker.conversations import Delivery, Head, SendResult, gate
from orderly.worker.core.errors import UnknownAck
from orderly.worker.delivery import response_headers
from orderly.worker.runtime import get_runtime
from orderly.worker.settings import get_settings
from orderly.worker.totals import TALLY
from tests.helpers import ManualClock, api_key
from tests.test_conversations import Harness, make

WELL_FORMED_ACK = "A" * 43  # an ACK token's form, signing nothing


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Api:
    """Apps made with the settings a test gives, on one clock the test moves; each client is
    an app of its own, at the client address it names (like API processes sharing Redis)."""

    clock: ManualClock
    stack: contextlib.ExitStack

    def client(self, address: str = "10.0.0.1", token: str | None = None) -> TestClient:
        """A client at ``address``, sending ``token`` as its API key (none when None)."""
        from orderly.api.http import create_app

        app = create_app()
        app.state.runtime.clock = self.clock
        headers = None if token is None else bearer(token)
        return self.stack.enter_context(TestClient(app, client=(address, 50_000), headers=headers))


@pytest.fixture
def api(
    db: Engine, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Api]]:
    stack = contextlib.ExitStack()

    def with_settings(**env: str) -> Api:
        # No node heartbeat while a test watches PostgreSQL's statements.
        quiet = {"ORDERLY_HEARTBEAT_INTERVAL": "600000", "ORDERLY_SERVICE_EXPIRE_MS": "1200000"}
        for name, value in {**quiet, **env}.items():
            monkeypatch.setenv(name, value)
        get_settings.cache_clear()
        get_runtime.cache_clear()
        return Api(ManualClock(), stack)

    yield with_settings
    stack.close()
    get_settings.cache_clear()
    get_runtime.cache_clear()


@contextlib.contextmanager
def postgresql_calls(engine: Engine) -> Iterator[list[str]]:
    """Every connection the engine hands out and every statement it runs meanwhile (observed
    through SQLAlchemy's events, nothing replaced), for the requests alone: the metrics'
    background writes (worker.totals) stop for the rest of the test."""
    TALLY.detach()
    seen: list[str] = []

    def checkout(*_: Any) -> None:
        seen.append("checkout")

    def statement(_c: Any, _cur: Any, text: str, *__: Any) -> None:
        seen.append(text)

    event.listen(engine, "checkout", checkout)
    event.listen(engine, "before_cursor_execute", statement)
    try:
        yield seen
    finally:
        event.remove(engine, "checkout", checkout)
        event.remove(engine, "before_cursor_execute", statement)


def _problem(answer: Any) -> dict[str, str]:
    problem: dict[str, str] = answer.json()["errors"][0]
    return problem


# --- per key, per address ---------------------------------------------------------------------


def test_a_key_over_its_limit_gets_429_with_retry_after_and_another_key_does_not(
    api: Callable[..., Api], db: Engine
) -> None:
    a = api(ORDERLY_RATE_KEY_PER_S="0.5", ORDERLY_RATE_KEY_BURST="3")
    http = a.client()
    busy, other = api_key(db, name="busy"), api_key(db, name="other")
    assert [http.get("/messages", headers=bearer(busy)).status_code for _ in range(3)] == [200] * 3
    refused = http.get("/messages", headers=bearer(busy))
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "2"  # a token every 2 s
    problem = _problem(refused)
    assert problem["field"] == "Authorization"
    assert "'busy'" in problem["problem"] and "ORDERLY_RATE_KEY_PER_S" in problem["problem"]
    assert http.get("/messages", headers=bearer(other)).status_code == 200
    a.clock.advance(1.9)
    assert http.get("/messages", headers=bearer(busy)).status_code == 429
    a.clock.advance(0.1)
    assert http.get("/messages", headers=bearer(busy)).status_code == 200


def test_an_address_over_its_limit_gets_429_on_every_route_and_another_does_not(
    api: Callable[..., Api], db: Engine
) -> None:
    a = api(ORDERLY_RATE_ADDRESS_PER_S="0.4", ORDERLY_RATE_ADDRESS_BURST="2")
    token = api_key(db)
    first, second = a.client("10.0.0.1", token), a.client("10.0.0.2", token)
    assert first.get("/health").status_code == 200
    assert first.get("/messages").status_code == 200
    # Before any route, credential or body: the public /health and an unknown path alike.
    for path in ("/health", "/nowhere", "/messages"):
        refused = first.get(path)
        assert refused.status_code == 429, path
        assert refused.headers["Retry-After"] == "3"  # 2.5 s, rounded up
        assert _problem(refused)["field"] == "client"
        assert "ORDERLY_RATE_ADDRESS_PER_S" in _problem(refused)["problem"]
    assert second.get("/messages").status_code == 200  # the same Redis, another address
    a.clock.advance(2.5)
    assert first.get("/messages").status_code == 200


def test_a_rate_of_0_is_no_limit_and_keeps_no_bucket(
    api: Callable[..., Api], db: Engine, redis_client: redis.Redis
) -> None:
    a = api(
        ORDERLY_RATE_ADDRESS_PER_S="0",
        ORDERLY_RATE_ADDRESS_BURST="1",
        ORDERLY_RATE_KEY_PER_S="0",
        ORDERLY_RATE_KEY_BURST="1",
    )
    http = a.client(token=api_key(db))
    assert {http.get("/messages").status_code for _ in range(30)} == {200}
    assert list(redis_client.scan_iter(match="orderly:rate:*")) == []


def test_the_default_limits_let_a_busy_producer_through(
    api: Callable[..., Api], db: Engine
) -> None:
    http = api().client(token=api_key(db))
    answers = [http.get("/messages").status_code for _ in range(300)]
    assert answers == [200] * 300


# --- refused credentials ----------------------------------------------------------------------


def test_unknown_keys_are_refused_from_memory_alike_whether_their_prefix_names_a_key(
    api: Callable[..., Api], db: Engine
) -> None:
    http = api(ORDERLY_RATE_REFUSED_BURST="1000").client()
    real = api_key(db, keys.OPERATE, name="ops")
    assert http.get("/messages", headers=bearer(real)).status_code == 200
    prefix = keys.key_prefix(real)
    guesses = [f"orderly_{prefix}_{n:043d}" for n in range(30)]  # the key's prefix, wrong
    guesses += [f"orderly_{n:012x}_{'x' * 43}" for n in range(30)]  # no key's prefix
    engine = get_runtime().engine

    def ask(token: str) -> Any:
        return http.get("/messages", headers=bearer(token))

    with postgresql_calls(engine) as calls, ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, guesses))
    assert {a.status_code for a in answers} == {401}
    assert {_problem(a)["problem"] for a in answers} == {keys.UNKNOWN_KEY}
    # No lookup by prefix, no thread each: a few loads of the directory, shared by all.
    statements = [c for c in calls if c != "checkout"]
    assert statements and set(statements) == {"SELECT secret_hash FROM api_key"}
    assert len(statements) <= len(guesses) // 5, len(statements)


def test_a_key_made_by_another_process_is_taken_at_its_first_request(
    api: Callable[..., Api], db: Engine
) -> None:
    http = api().client(token=api_key(db))
    assert http.get("/messages").status_code == 200  # the directory is loaded
    made_now = api_key(db, keys.OPERATE, name="new")  # PostgreSQL only, as the CLI does
    assert http.get("/messages", headers=bearer(made_now)).status_code == 200


def test_refused_keys_count_against_the_address_malformed_ones_do_not(
    api: Callable[..., Api], db: Engine
) -> None:
    a = api(ORDERLY_RATE_REFUSED_PER_S="1", ORDERLY_RATE_REFUSED_BURST="3")
    http, elsewhere = a.client("10.0.0.1"), a.client("10.0.0.2")
    good = api_key(db, keys.OPERATE, name="ops")
    assert http.get("/messages", headers=bearer(good)).status_code == 200  # held from now on
    unknown = bearer(f"orderly_{'0' * 12}_{'x' * 43}")
    for _ in range(10):  # no guess: refused as ever, uncounted
        assert http.get("/messages", headers=bearer("not-a-key")).status_code == 401
        assert http.get("/messages", headers={}).status_code == 401
    assert [http.get("/messages", headers=unknown).status_code for _ in range(3)] == [401] * 3
    over = http.get("/messages", headers=unknown)
    assert over.status_code == 429 and over.headers["Retry-After"] == "1"
    assert "ORDERLY_RATE_REFUSED_PER_S" in _problem(over)["problem"]
    # Refused before the check while over: no load of the directory, no lookup.
    with postgresql_calls(get_runtime().engine) as calls:
        assert http.get("/messages", headers=unknown).status_code == 429
    assert calls == []
    # A key already verified is not locked out with its address; another address is not.
    assert http.get("/messages", headers=bearer(good)).status_code == 200
    assert elsewhere.get("/messages", headers=unknown).status_code == 401
    a.clock.advance(1)
    assert http.get("/messages", headers=unknown).status_code == 401


def test_an_unknown_ack_is_refused_without_postgresql_or_a_wait_and_counts(
    api: Callable[..., Api], db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = api(ORDERLY_RATE_REFUSED_PER_S="1", ORDERLY_RATE_REFUSED_BURST="3")
    http = a.client()
    guess = {ACK_TOKEN_HEADER: WELL_FORMED_ACK}
    assert http.post("/acks/warm-up", headers=guess).status_code == 404  # the runtime's wiring
    looked = _watch_lookups(monkeypatch)
    with postgresql_calls(get_runtime().engine) as calls:
        answers = [http.post(f"/acks/guess-{n}", headers=guess) for n in range(2)]
    assert [x.status_code for x in answers] == [404, 404]
    assert calls == []
    assert looked == ["guess-0", "guess-1"]  # one look each: no grace wait
    over = http.post("/acks/guess-3", headers=guess)
    assert over.status_code == 429 and over.headers["Retry-After"] == "1"
    # A token not in an ACK token's form is refused as ever, uncounted.
    a.clock.advance(1)
    for _ in range(5):
        assert http.post("/acks/x", headers={ACK_TOKEN_HEADER: "short"}).status_code == 401
    assert http.post("/acks/guess-4", headers=guess).status_code == 404


def _watch_lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every look for an ACK id (gate.find_ack), recorded as it passes: more than one for an
    ACK is its grace wait."""
    looked: list[str] = []
    find_ack = gate.find_ack

    def watched(ctx: Any, async_response_id: str) -> Any:
        looked.append(async_response_id)
        return find_ack(ctx, async_response_id)

    monkeypatch.setattr(gate, "find_ack", watched)
    return looked


@pytest.fixture
def h(db: Engine, redis_client: redis.Redis) -> Harness:
    return make(db, redis_client)


def test_an_ack_before_its_202_is_recorded_waits_for_it_and_a_guess_does_not(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client may ACK while the worker has not yet recorded its 202: that ACK (its token
    the response's) waits for the record; a wrong token at the same moment is refused at
    once, and the response still takes its own ACK."""
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2", last=True)
    looked = _watch_lookups(monkeypatch)
    outcome: dict[str, Any] = {}

    def client_acks(token: str) -> None:
        try:
            outcome["msg_id"] = h.conv.ack("early-1", h.enqueue, token)
        except Exception as exc:
            outcome["error"] = exc

    def send(channel: Channel, head: Head) -> SendResult:
        token = response_headers(channel, head)[ACK_TOKEN_HEADER]
        if head.response_id == "s1":
            # A guess while s1 is in flight: refused at once, no grace.
            with pytest.raises(UnknownAck):
                h.conv.ack("early-1", h.enqueue, WELL_FORMED_ACK)
            assert looked == ["early-1"]
            # The client's own ACK, before the 202 below is recorded: it waits.
            threading.Thread(target=client_acks, args=(token,), daemon=True).start()
            assert _soon(lambda: len(looked) >= 3), "the early ACK did not wait"
            return SendResult(Delivery.ASYNC, 202, "early-1")
        return SendResult(Delivery.DELIVERED, 200)

    h.run(send)
    assert _soon(lambda: bool(outcome))
    assert "msg_id" in outcome, outcome
    assert h.state("s1") == "OK"


def _soon(condition: Callable[[], bool], within_s: float = 10.0) -> bool:
    """Whether ``condition`` holds within ``within_s``, looked at every millisecond (the early
    ACK's grace is ~130 ms: a coarser look could miss it)."""
    deadline = time.monotonic() + within_s
    tick = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            return False
        tick.wait(0.001)
    return True


# --- the console's sign-in --------------------------------------------------------------------


def test_console_sign_ins_are_throttled_per_address_and_per_key_tried(
    api: Callable[..., Api], db: Engine
) -> None:
    a = api(ORDERLY_RATE_LOGIN_PER_MIN="2", ORDERLY_RATE_LOGIN_BURST="2")
    here, there, third = a.client("10.0.0.1"), a.client("10.0.0.2"), a.client("10.0.0.3")
    real = api_key(db, keys.OPERATE, name="ops")
    guess = f"orderly_{keys.key_prefix(real)}_{'x' * 43}"  # the key's prefix, a wrong secret

    def sign_in(http: TestClient, token: str) -> Any:
        return http.post("/console/login", data={"key": token}, follow_redirects=False)

    assert [sign_in(here, "not-a-key").status_code for _ in range(2)] == [401, 401]
    over = sign_in(here, real)  # the address's two are spent: even the right key waits
    assert over.status_code == 429 and over.headers["Retry-After"] == "30"
    assert "too many sign-ins from 10.0.0.1" in over.text and 'name="key"' in over.text
    # The key tried: two guesses from one address, the third from another is refused.
    assert [sign_in(there, guess).status_code for _ in range(2)] == [401, 401]
    named = sign_in(third, guess)
    assert named.status_code == 429 and "too many sign-ins with the key" in named.text
    a.clock.advance(30)
    assert sign_in(third, real).status_code == 303  # a token back for the key: signed in
