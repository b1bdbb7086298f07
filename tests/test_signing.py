"""Signed outbound requests (worker.signing, worker.core.http) against the real PostgreSQL and
a real local HTTP server: each destination's secret, made on first use; the four kinds of
POST carry Standard Webhooks signatures a receiver verifies with orderly.client.webhooks;
a rotation signs with both secrets until the previous one's time is up."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.client.webhooks import InvalidSignature, verify
from orderly.worker.channels import Channel
from orderly.worker.conversations import Delivery, Head
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.core.http import HttpOptions, OutboundHttp, SignedAs
from orderly.worker.delivery import HttpSender
from orderly.worker.pubsub.claims import Claimed
from orderly.worker.signing import SigningSecrets
from tests.helpers import LOOPBACK
from tests.test_http_client import _Server, server  # noqa: F401 (the recording server)


@pytest.fixture
def sink(request: pytest.FixtureRequest) -> _Server:
    """tests.test_http_client's recording server (its ``server`` fixture)."""
    found: _Server = request.getfixturevalue("server")
    return found


def url_of(sink: _Server) -> str:
    return sink.base + "/in"


def _head(msg_id: int) -> Head:
    return Head(
        conversation_id="c1",
        origin="chat",
        request_id="r1",
        response_id="s1",
        payload={"text": "hi"},
        msg_id=msg_id,
        request_msg_id=1,
        last=False,
        attempt=0,
        awaited_retries=0,
        late_ms=None,
    )


def _claimed(url: str, delivery_id: int, subscription_id: int, attempt: int = 0) -> Claimed:
    now = datetime.now(UTC)
    return Claimed(
        delivery_id=delivery_id,
        attempt=attempt,
        event_id=9,
        correlation_id="evt.with.dots",
        routing_key="a.b",
        payload={"x": 1},
        user=None,
        impersonator=None,
        deliver_at=now,
        expires_at=None,
        version=None,
        subscription_id=subscription_id,
        kind="PUSH",
        push_url=url,
        handler=None,
        timeout_ms=5000,
        delay_ms=10,
        multiplier=2.0,
        attempts=3,
        room="r",
        token=None,
        order_value=None,
        delayed=False,
    )


def test_a_destination_gets_one_secret_on_first_use_and_keeps_it(db: Engine) -> None:
    secrets = SigningSecrets(db)
    first = secrets.get("channel", "chat")
    assert first.secret.startswith("whsec_") and first.previous is None
    assert secrets.get("channel", "chat").secret == first.secret
    assert secrets.get("subscription", "7").secret != first.secret  # one per destination
    with pytest.raises(InvalidMessage, match="kind"):
        secrets.get("endpoint", "chat")
    with pytest.raises(InvalidMessage, match="name"):
        secrets.get("channel", "")
    with pytest.raises(InvalidMessage, match="keep_previous_s"):
        secrets.rotate("channel", "chat", keep_previous_s=-1)


def test_senders_racing_for_a_destinations_first_secret_all_get_it(db: Engine) -> None:
    # Two pool children send the first deliveries of a new subscription at once: the one
    # whose insert lost waited for the winner's commit, which its statement did not see.
    for n in range(100):
        start = threading.Barrier(8)

        def first_use(name: str = f"race-{n}", start: threading.Barrier = start) -> str:
            start.wait(10)
            return SigningSecrets(db).get("channel", name).secret

        with ThreadPoolExecutor(8) as pool:
            secrets = set(pool.map(lambda _: first_use(), range(8)))
        assert len(secrets) == 1


def test_conversation_sends_pushes_and_posts_are_signed_for_their_destination(
    db: Engine, sink: _Server
) -> None:
    secrets = SigningSecrets(db)
    http = OutboundHttp(HttpOptions(policy=LOOPBACK), signer=secrets.for_send)
    send = HttpSender(http)
    channel = Channel("chat", url_of(sink), 10, 2.0, 2, 5000, ack_secret="s" * 64)
    # the test server answers 202 with an async id: the client took it
    assert send(channel, _head(41)).kind is Delivery.ASYNC
    assert send.push(_claimed(url_of(sink), 77, 5)).ok
    reply = http.post(
        url_of(sink),
        b'{"a":1}',
        timeout_ms=5000,
        signed_as=SignedAs("source_system", "crm", "cnf_12"),
    )
    assert reply.ok
    [
        (_, res_body, res_headers, _),
        (_, push_body, push_headers, _),
        (_, cnf_body, cnf_headers, _),
    ] = sink.seen
    verify(secrets.get("channel", "chat").secret, res_headers, res_body)
    verify(secrets.get("subscription", "5").secret, push_headers, push_body)
    verify(secrets.get("source_system", "crm").secret, cnf_headers, cnf_body)
    ids = [h["webhook-id"] for h in (res_headers, push_headers, cnf_headers)]
    assert ids == ["res_41", "dlv_77", "cnf_12"]  # the same for every attempt of a delivery
    # another destination's secret does not verify
    with pytest.raises(InvalidSignature):
        verify(secrets.get("channel", "chat").secret, push_headers, push_body)


def test_a_rotation_signs_with_both_secrets_until_the_previous_ones_time_is_up(
    db: Engine, sink: _Server
) -> None:
    secrets = SigningSecrets(db)
    http = OutboundHttp(HttpOptions(policy=LOOPBACK), signer=secrets.for_send)
    target = SignedAs("subscription", "5", "dlv_1")
    assert http.post(url_of(sink), b"{}", timeout_ms=5000, signed_as=target).ok
    old = secrets.get("subscription", "5").secret
    rotated = secrets.rotate("subscription", "5", keep_previous_s=3600)
    assert rotated.previous == old and rotated.secret != old
    assert http.post(url_of(sink), b"{}", timeout_ms=5000, signed_as=target).ok
    _, body, sent, _ = sink.seen[-1]
    assert len(sent["webhook-signature"].split()) == 2
    verify(old, sent, body)  # a receiver still on the old secret
    verify(rotated.secret, sent, body)  # and one that switched
    final = secrets.rotate("subscription", "5", keep_previous_s=0)
    assert final.previous is None
    assert http.post(url_of(sink), b"{}", timeout_ms=5000, signed_as=target).ok
    _, body, sent, _ = sink.seen[-1]
    verify(final.secret, sent, body)
    with pytest.raises(InvalidSignature):
        verify(rotated.secret, sent, body)


def test_without_a_signer_or_a_destination_nothing_is_signed_and_a_lost_secret_is_no_send(
    db: Engine, sink: _Server
) -> None:
    plain = OutboundHttp(HttpOptions(policy=LOOPBACK))
    assert plain.post(
        url_of(sink), b"{}", timeout_ms=5000, signed_as=SignedAs("channel", "x", "i")
    ).ok
    assert "webhook-signature" not in {k.lower() for k in sink.seen[-1][2]}

    def broken(kind: str, name: str) -> list[str]:
        raise ConnectionError("PostgreSQL is gone")

    failing = OutboundHttp(HttpOptions(policy=LOOPBACK), signer=broken)
    reply = failing.post(
        url_of(sink), b"{}", timeout_ms=5000, signed_as=SignedAs("channel", "x", "i")
    )
    assert reply.status is None and "no signing secret" in reply.error
    assert len(sink.seen) == 1  # nothing unsigned went out


def test_every_delivery_says_its_attempt_and_the_wait_before_the_next(
    db: Engine, sink: _Server
) -> None:
    """X-Orderly-Attempt: the send's number (1: the first); X-Orderly-Next-Delay-Ms: the wait
    after its failure (delay * multiplier^attempt), absent when no send follows."""
    send = HttpSender(OutboundHttp(HttpOptions(policy=LOOPBACK)))
    channel = Channel("chat", url_of(sink), 10, 2.0, 2, 5000, ack_secret="s" * 64)
    send(channel, _head(41))  # a first send: retry 1 follows a failure, 10 * 2^1 ms later
    send.push(_claimed(url_of(sink), 77, 5, attempt=1))  # the second: 10 * 2^2
    send.push(_claimed(url_of(sink), 78, 5, attempt=3))  # the fourth of 1 + 3: the last
    seen = [{k.lower(): v for k, v in h.items()} for _, _, h, _ in sink.seen]
    shown = [(h["x-orderly-attempt"], h.get("x-orderly-next-delay-ms")) for h in seen]
    assert shown == [("1", "20"), ("2", "40"), ("4", None)]


def test_a_tenant_sees_and_rotates_only_its_own_destinations_secrets(
    db: Engine, client: TestClient
) -> None:
    assert client.post("/rooms", json={"name": "r"}).status_code == 201
    subs = [
        client.post("/rooms/r/subscriptions", json={"name": n, "kind": "PULL"}).json()[
            "subscription_id"
        ]
        for n in ("mine", "theirs")
    ]
    owns = {"source_systems": [], "origins": [], "subscriptions": [subs[0]]}
    made = client.post("/keys", json={"name": "tenant", "scopes": ["operate"], "owns": owns})
    tenant = {"Authorization": f"Bearer {made.json()['token']}"}

    def rows() -> int:
        with db.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM signing_secret")).scalar_one())

    mine = client.get(f"/signing-secrets/subscription/{subs[0]}", headers=tenant)
    assert mine.status_code == 200, mine.text
    assert mine.json()["secret"] == SigningSecrets(db).get("subscription", str(subs[0])).secret
    before = rows()
    for method, path in (
        ("get", f"/signing-secrets/subscription/{subs[1]}"),
        ("post", f"/signing-secrets/subscription/{subs[1]}/rotate"),
        ("get", "/signing-secrets/subscription/999999"),
        ("get", "/signing-secrets/source_system/crm"),
    ):
        answer = client.request(method, path, headers=tenant, json={} if method == "post" else None)
        assert answer.status_code == 404, (path, answer.text)
    assert client.get("/signing-secrets/subscription/999999").status_code == 404  # unbound too
    assert rows() == before  # nothing made for what is not there or not theirs
    rotated = client.post(
        f"/signing-secrets/subscription/{subs[0]}/rotate",
        headers=tenant,
        json={"keep_previous_s": 60},
    ).json()
    assert rotated["previous"] == mine.json()["secret"] != rotated["secret"]
    refused = client.post(
        f"/signing-secrets/subscription/{subs[0]}/rotate",
        headers=tenant,
        json={"keep_previous_s": -1},
    )
    assert refused.status_code == 422 and "keep_previous_s" in refused.text
    assert SigningSecrets(db).get("subscription", str(subs[0])).secret == rotated["secret"]
    wrong_kind = client.get("/signing-secrets/endpoint/x", headers=tenant)
    assert wrong_kind.status_code == 422 and "kind" in wrong_kind.text
