"""Signed requests (orderly.client.webhooks): the Standard Webhooks scheme, checked against
the specification's published test vector, and what a receiver's verify refuses."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from orderly.client import webhooks
from orderly.client.webhooks import InvalidSignature, headers, new_secret, sign, verify

# The test vector the Standard Webhooks libraries are checked against.
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_the_signature_is_the_specifications_test_vector() -> None:
    assert sign(VECTOR_SECRET, VECTOR_ID, VECTOR_TS, VECTOR_BODY) == VECTOR_SIGNATURE
    # the key alone, without its prefix, is the same key
    assert sign(VECTOR_SECRET.removeprefix("whsec_"), VECTOR_ID, VECTOR_TS, VECTOR_BODY) == (
        VECTOR_SIGNATURE
    )
    sent = {
        "webhook-id": VECTOR_ID,
        "webhook-timestamp": str(VECTOR_TS),
        "webhook-signature": VECTOR_SIGNATURE,
    }
    verify(VECTOR_SECRET, sent, VECTOR_BODY, now=VECTOR_TS + 10)


def test_a_rotation_signs_with_both_secrets_and_either_verifies() -> None:
    old, new = new_secret(), new_secret()
    assert old.startswith("whsec_") and old != new
    sent = headers([new, old], "res_42", b'{"a":1}', timestamp=1_700_000_000)
    assert len(sent["webhook-signature"].split()) == 2
    for receiver_knows in (old, new, [new_secret(), old]):
        verify(receiver_knows, sent, b'{"a":1}', now=1_700_000_001)
    with pytest.raises(InvalidSignature, match="no signature matches"):
        verify(new_secret(), sent, b'{"a":1}', now=1_700_000_001)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda h, b: (h, b + b" "), "no signature matches"),  # the body changed on the way
        (lambda h, b: ({**h, "webhook-id": "res_43"}, b), "no signature matches"),
        (lambda h, b: ({**h, "webhook-id": "a.b"}, b), "must not contain"),
        (lambda h, b: ({**h, "webhook-timestamp": "1700000001"}, b), "no signature matches"),
        (lambda h, b: ({**h, "webhook-timestamp": "soon"}, b), "not a Unix time"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "webhook-id"}, b), "missing"),
        (lambda h, b: ({**h, "webhook-signature": "v2,abc v1a,xyz"}, b), "no signature"),
    ],
)
def test_verify_refuses_what_the_secret_holder_did_not_send(
    change: Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]], problem: str
) -> None:
    secret = new_secret()
    body = b'{"a":1}'
    sent, got = change(headers([secret], "res_42", body, timestamp=1_700_000_000), body)
    with pytest.raises(InvalidSignature, match=problem):
        verify(secret, sent, got, now=1_700_000_000)


def test_verify_holds_the_timestamp_to_its_tolerance_and_reads_headers_in_any_case() -> None:
    secret = new_secret()
    sent = headers([secret], "res_42", b"{}", timestamp=1_700_000_000)
    shouting = {k.upper(): v for k, v in sent.items()}
    verify(secret, shouting, b"{}", now=1_700_000_000 + webhooks.TOLERANCE_S)
    verify(secret, sent, "{}", now=1_700_000_000 - webhooks.TOLERANCE_S)
    for off in (webhooks.TOLERANCE_S + 1, -webhooks.TOLERANCE_S - 1):
        with pytest.raises(InvalidSignature, match="from now"):
            verify(secret, sent, b"{}", now=1_700_000_000 + off)
    with pytest.raises(InvalidSignature, match="from now"):
        verify(secret, sent, b"{}", now=1_700_000_000 + 60, tolerance_s=30)


def test_a_sender_refuses_an_id_with_a_dot_and_a_secret_that_is_no_base64() -> None:
    with pytest.raises(ValueError, match="must not contain"):
        sign(new_secret(), "evt.1", 1, b"")
    with pytest.raises(ValueError, match="base64"):
        sign("whsec_not base64!", "evt_1", 1, b"")
