"""The outbound address policy: internal addresses refused at registration and at send time
(after DNS resolution), allowed when allow-listed."""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from sqlalchemy import Engine, text

from orderly.worker import channels, pubsub
from orderly.worker.core.addresses import STRICT, AddressPolicy
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.core.http import HttpOptions, OutboundHttp
from orderly.worker.messages import confirmations
from orderly.worker.settings import Settings

INTERNAL = [
    "127.0.0.1",
    "127.8.9.10",
    "::1",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "100.64.0.1",
    "169.254.169.254",
    "fe80::1",
    "fd00:ec2::254",
    "0.0.0.0",
    "::ffff:127.0.0.1",
    "2002:7f00:1::1",  # 6to4 around 127.0.0.1
    "2001:0:4136:e378:8000:63bf:f5ff:fffe",  # Teredo around 10.0.0.1 (its bits inverted)
    "fec0::1",
    "224.0.0.1",
    "240.0.0.1",
]


@pytest.mark.parametrize("address", INTERNAL)
def test_internal_addresses_are_refused_by_default(address: str) -> None:
    why = STRICT.refusal(ipaddress.ip_address(address))
    assert why is not None and "internal address" in why


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    assert STRICT.refusal(ipaddress.ip_address(address)) is None


def test_the_allow_list_admits_networks_and_hosts() -> None:
    policy = AddressPolicy.parse(" 10.1.0.0/16, 127.0.0.1 ,Sink.Internal")
    assert policy.refusal(ipaddress.ip_address("10.1.200.3")) is None
    assert policy.refusal(ipaddress.ip_address("127.0.0.1")) is None
    assert policy.refusal(ipaddress.ip_address("10.2.0.1")) is not None
    assert policy.refusal(ipaddress.ip_address("127.0.0.2")) is not None
    assert policy.allows_host("sink.internal") and not policy.allows_host("other.internal")
    with pytest.raises(ValueError, match="'not a host!'"):
        AddressPolicy.parse("10.0.0.0/8, not a host!")


def test_the_setting_is_validated_and_has_its_effect() -> None:
    with pytest.raises(ValueError, match="not an address, a network or a host name"):
        Settings(ORDERLY_OUTBOUND_ALLOW="300.1.1.1/99, %%")
    settings = Settings(ORDERLY_OUTBOUND_ALLOW="192.168.0.0/16")
    assert settings.outbound_policy.refusal(ipaddress.ip_address("192.168.3.4")) is None
    assert Settings(ORDERLY_OUTBOUND_ALLOW="").outbound_policy == STRICT


# --- registration ------------------------------------------------------------------------


URLS = [
    "http://127.0.0.1:8080/in",
    "http://[::1]/in",
    "http://10.0.0.5/in",
    "http://169.254.169.254/latest/meta-data/",
    "http://localhost:9/in",  # a name that resolves to loopback
]


def _counts(db: Engine) -> tuple[int, int, int]:
    with db.connect() as conn:
        return (
            conn.execute(text("SELECT count(*) FROM channel")).scalar_one(),
            conn.execute(text("SELECT count(*) FROM subscription")).scalar_one(),
            conn.execute(text("SELECT count(*) FROM source_system")).scalar_one(),
        )


@pytest.mark.parametrize("url", URLS)
def test_internal_urls_are_refused_at_registration_and_nothing_is_stored(
    db: Engine, url: str
) -> None:
    with pytest.raises(InvalidMessage) as caught:
        channels.validate("chat", {"url": url}, Settings(ORDERLY_OUTBOUND_ALLOW=""))
    assert caught.value.field == "url" and "outbound address policy" in caught.value.problem
    pubsub.create_room(db, {"name": "r"})
    before = _counts(db)
    with pytest.raises(InvalidMessage) as caught:
        pubsub.create_subscription(
            db, "r", {"name": "s", "kind": "PUSH", "push_url": url}, policy=STRICT
        )
    assert caught.value.field == "push_url"
    with pytest.raises(InvalidMessage) as caught:
        confirmations.set_source_system(db, "crm", {"confirmation_url": url}, policy=STRICT)
    assert caught.value.field == "confirmation_url"
    assert _counts(db) == before


def test_allow_listed_urls_are_registered(db: Engine) -> None:
    policy = AddressPolicy.parse("127.0.0.1, localhost")
    pubsub.create_room(db, {"name": "r"})
    for n, url in enumerate(("http://127.0.0.1:9/in", "http://localhost:9/in")):
        pubsub.create_subscription(
            db, "r", {"name": f"s{n}", "kind": "PUSH", "push_url": url}, policy=policy
        )
    sub = pubsub.create_subscription(
        db,
        "r",
        {"name": "later", "kind": "PUSH", "push_url": "http://127.0.0.1:9/a"},
        policy=policy,
    )
    # Changing it to an internal address later is checked too; other changes are not.
    with pytest.raises(InvalidMessage):
        pubsub.update_subscription(
            db, sub["subscription_id"], {"push_url": "http://10.0.0.1/"}, policy=STRICT
        )
    pubsub.update_subscription(db, sub["subscription_id"], {"status": "PAUSED"}, policy=STRICT)
    confirmations.set_source_system(
        db, "crm", {"confirmation_url": "http://127.0.0.1:9/c"}, policy=policy
    )
    assert _counts(db)[1:] == (3, 1)


# --- send time ---------------------------------------------------------------------------


class _Hits(ThreadingHTTPServer):
    hits = 0


class _Answer(BaseHTTPRequestHandler):
    server: _Hits

    def do_POST(self) -> None:
        self.server.hits += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[_Hits]:
    srv = _Hits(("127.0.0.1", 0), _Answer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_a_send_to_an_internal_address_is_refused_after_resolution(server: _Hits) -> None:
    port = server.server_address[1]
    assert socket.gethostbyname("localhost") == "127.0.0.1"
    strict = OutboundHttp(HttpOptions(policy=STRICT))
    for url in (f"http://127.0.0.1:{port}/x", f"http://localhost:{port}/x"):
        reply = strict.post_json(url, {}, timeout_ms=2000)
        assert reply.status is None and "outbound address policy" in reply.error
    assert (
        "localhost resolves to 127.0.0.1"
        in strict.post_json(f"http://localhost:{port}/x", {}, timeout_ms=2000).error
    )
    assert server.hits == 0  # no connection was made
    by_network = OutboundHttp(HttpOptions(policy=AddressPolicy.parse("127.0.0.0/8")))
    by_name = OutboundHttp(HttpOptions(policy=AddressPolicy.parse("localhost")))
    assert by_network.post_json(f"http://localhost:{port}/x", {}, timeout_ms=2000).status == 200
    assert by_name.post_json(f"http://localhost:{port}/x", {}, timeout_ms=2000).status == 200
    # Allowed by name, not by address: the literal address is still refused.
    assert by_name.post_json(f"http://127.0.0.1:{port}/x", {}, timeout_ms=2000).status is None
    assert server.hits == 2
