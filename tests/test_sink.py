"""The client sink over real HTTP: answers, ACKs, rules, the seeded mix, the log, the CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tooling.sink import BehaviourError, Sink

ROOT = Path(__file__).resolve().parent.parent


class FakeOrderly:
    """Stands in for orderly's API: records every ACK POST and answers ``status``."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.acks: list[tuple[str, bytes, float]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with fake._lock:
                    fake.acks.append((self.path, body, time.time()))
                self.send_response(fake.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def paths(self) -> list[str]:
        with self._lock:
            return [path for path, _, _ in self.acks]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def sink() -> Iterator[Sink]:
    with Sink() as s:
        yield s


@pytest.fixture
def orderly() -> Iterator[FakeOrderly]:
    fake = FakeOrderly()
    yield fake
    fake.close()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5.0) as c:
        yield c


def deliver(
    client: httpx.Client, sink: Sink, response_id: str, conversation_id: str = "c1"
) -> httpx.Response:
    return client.post(
        sink.url,
        json={
            "conversation_id": conversation_id,
            "request_id": f"rq-{response_id}",
            "response_id": response_id,
            "payload": {"text": "hello"},
        },
        headers={"Idempotency-Key": response_id},
    )


def wait_for(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_sync_delivery_is_answered_200_and_logged(sink: Sink, client: httpx.Client) -> None:
    before = time.time()
    answer = deliver(client, sink, "rs1")
    assert answer.status_code == 200 and answer.json() == {}
    health = client.get(f"{sink.base_url}/_sink/health")
    assert health.status_code == 200 and health.json() == {"ok": True}

    (arrival,) = client.get(f"{sink.base_url}/_sink/log").json()["arrivals"]
    assert arrival["seq"] == 1 and arrival["attempt"] == 1 and arrival["status"] == 200
    assert (arrival["conversation_id"], arrival["request_id"]) == ("c1", "rq-rs1")
    assert arrival["response_id"] == arrival["key"] == "rs1"
    assert before <= arrival["t_arrival"] <= arrival["t_responded"] <= time.time()
    assert arrival["duplicate"] is False and arrival["delay_ms"] == 0
    assert arrival["async_response_id"] is None and arrival["ack_status"] is None
    assert arrival["payload"] == {"text": "hello"}
    assert sink.arrivals() == [arrival]


def test_any_path_but_the_control_one_is_a_delivery(sink: Sink, client: httpx.Client) -> None:
    answer = client.post(
        f"{sink.base_url}/some/other/channel",
        json={"conversation_id": "c", "request_id": "q", "response_id": "r", "payload": None},
    )
    assert answer.status_code == 200
    assert sink.arrivals()[0]["key"] == "r"  # no Idempotency-Key header: the response id


def test_202_is_acked_to_orderly_after_the_delay(
    sink: Sink, orderly: FakeOrderly, client: httpx.Client
) -> None:
    sink.configure(p_async=1.0, ack_delay_ms=[80, 100], orderly_url=orderly.url)
    answer = deliver(client, sink, "rs1")
    assert answer.status_code == 202
    async_id = answer.json()["async_response_id"]
    assert isinstance(async_id, str) and async_id

    wait_for(lambda: sink.arrivals()[0]["ack_status"] is not None)
    assert orderly.paths() == [f"/acks/{async_id}"]
    assert orderly.acks[0][1] == b""
    (arrival,) = sink.arrivals()
    assert arrival["status"] == 202 and arrival["async_response_id"] == async_id
    assert arrival["ack_status"] == 200
    assert arrival["t_ack"] - arrival["t_responded"] >= 0.08


def test_ack_status_is_what_orderly_answered(sink: Sink, client: httpx.Client) -> None:
    fake = FakeOrderly(status=404)
    try:
        sink.configure(
            rules=[{"match": {}, "status": 202}], ack_delay_ms=[0, 0], orderly_url=fake.url
        )
        assert deliver(client, sink, "rs1").status_code == 202
        wait_for(lambda: sink.arrivals()[0]["ack_status"] is not None)
        assert sink.arrivals()[0]["ack_status"] == 404
    finally:
        fake.close()


def test_a_held_back_202_is_acked_after_it_went_out(
    sink: Sink, orderly: FakeOrderly, client: httpx.Client
) -> None:
    sink.configure(
        rules=[{"match": {}, "status": 202, "delay_ms": 150}],
        ack_delay_ms=[0, 0],
        orderly_url=orderly.url,
    )
    t0 = time.time()
    assert deliver(client, sink, "rs1").status_code == 202
    assert time.time() - t0 >= 0.15
    wait_for(lambda: sink.arrivals()[0]["ack_status"] == 200)
    (arrival,) = sink.arrivals()
    assert arrival["delay_ms"] == 150
    assert arrival["t_arrival"] + 0.15 <= arrival["t_responded"] <= arrival["t_ack"]
    assert orderly.acks[0][2] >= arrival["t_responded"]


def test_never_ack_sends_nothing(sink: Sink, orderly: FakeOrderly, client: httpx.Client) -> None:
    sink.configure(
        orderly_url=orderly.url,
        ack_delay_ms=[0, 10],
        rules=[
            {"match": {"response_id": "silent"}, "status": 202, "never_ack": True},
            {"match": {}, "status": 202},
        ],
    )
    silent = deliver(client, sink, "silent").json()["async_response_id"]
    acked = deliver(client, sink, "acked").json()["async_response_id"]
    wait_for(lambda: sink.arrivals()[1]["ack_status"] is not None)
    time.sleep(0.1)
    assert orderly.paths() == [f"/acks/{acked}"]
    first = sink.arrivals()[0]
    assert first["async_response_id"] == silent and first["ack_status"] is None
    assert first["t_ack"] is None


def test_random_never_ack_fraction(sink: Sink, orderly: FakeOrderly, client: httpx.Client) -> None:
    sink.configure(
        seed=5, p_async=1.0, p_never_ack=0.5, ack_delay_ms=[0, 5], orderly_url=orderly.url
    )
    for i in range(200):
        assert deliver(client, sink, f"rs{i}").status_code == 202

    def acked() -> int:
        return sum(1 for a in sink.arrivals() if a["ack_status"] == 200)

    # Settled: the count holds still across a pause and orderly saw every one of them.
    seen = [-1]

    def settled() -> bool:
        now, before = acked(), seen[0]
        seen[0] = now
        time.sleep(0.1)
        return now == before == len(orderly.acks)

    wait_for(settled)
    assert 60 <= acked() <= 140


def test_rules_apply_in_order_for_their_number_of_times(sink: Sink, client: httpx.Client) -> None:
    sink.configure(
        rules=[
            {"match": {"response_id": "rs1"}, "status": 503, "times": 2},
            {"match": {"conversation_id": "c2"}, "status": 400},
            {"match": {"response_id": "rs1"}, "status": 429, "times": 1},
        ]
    )
    statuses = [deliver(client, sink, "rs1").status_code for _ in range(5)]
    assert statuses == [503, 503, 429, 200, 200]
    assert deliver(client, sink, "rs2").status_code == 200
    assert deliver(client, sink, "rs3", conversation_id="c2").status_code == 400
    assert deliver(client, sink, "rs4", conversation_id="c2").status_code == 400
    assert [a["attempt"] for a in sink.arrivals()[:5]] == [1, 2, 3, 4, 5]

    sink.reset()  # the counts start over with the log
    assert deliver(client, sink, "rs1").status_code == 503
    assert sink.arrivals()[0]["seq"] == 1


def test_a_rule_may_answer_any_error_status(sink: Sink, client: httpx.Client) -> None:
    sink.configure(rules=[{"match": {"response_id": "odd"}, "status": 599, "times": 1}])
    answer = deliver(client, sink, "odd")
    assert answer.status_code == 599 and answer.json() == {"error": "Unknown"}
    assert deliver(client, sink, "odd").status_code == 200


def test_duplicates_and_deliveries(sink: Sink, client: httpx.Client) -> None:
    sink.configure(rules=[{"match": {"response_id": "rs1"}, "status": 503, "times": 1}])
    assert deliver(client, sink, "rs1").status_code == 503
    assert deliver(client, sink, "rs2").status_code == 200
    assert deliver(client, sink, "rs1").status_code == 200
    assert deliver(client, sink, "rs1").status_code == 200
    assert deliver(client, sink, "rs3", conversation_id="c2").status_code == 200
    assert deliver(client, sink, "rs2").status_code == 200

    arrivals = sink.arrivals()
    assert [(a["key"], a["duplicate"]) for a in arrivals] == [
        ("rs1", False),
        ("rs2", False),
        ("rs1", False),
        ("rs1", True),
        ("rs3", False),
        ("rs2", True),
    ]
    expected = {"c1": ["rs2", "rs1"], "c2": ["rs3"]}
    assert sink.deliveries() == expected
    assert client.get(f"{sink.base_url}/_sink/deliveries").json() == {"conversations": expected}

    since = client.get(f"{sink.base_url}/_sink/log", params={"since": 4}).json()["arrivals"]
    assert [a["seq"] for a in since] == [5, 6]
    assert client.delete(f"{sink.base_url}/_sink/log").status_code == 200
    assert sink.arrivals() == [] and sink.deliveries() == {}
    deliver(client, sink, "rs2")
    assert sink.arrivals()[0]["duplicate"] is False and sink.arrivals()[0]["attempt"] == 1


MIX = {
    "p_recoverable": 0.2,
    "p_timeout": 0.05,
    "p_non_recoverable": 0.1,
    "p_async": 0.25,
    "p_never_ack": 1.0,
    "timeout_sleep_ms": 100,
}


def run_mix(sink: Sink, keys: list[list[str]], repeats: list[str]) -> dict[tuple[str, int], str]:
    """Deliver each list of keys from its own thread, then ``repeats`` in order; classify the
    answers, a timeout told apart from a plain 503 by the delay the sink logged."""
    sink.reset()

    def send(chunk: list[str]) -> None:
        with httpx.Client(timeout=5.0) as c:
            for key in chunk:
                deliver(c, sink, key)

    threads = [threading.Thread(target=send, args=(chunk,)) for chunk in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    send(repeats)
    outcome: dict[tuple[str, int], str] = {}
    for a in sink.arrivals():
        if a["delay_ms"]:
            assert a["status"] == 503 and a["t_responded"] - a["t_arrival"] >= 0.1
        outcome[(a["key"], a["attempt"])] = "timeout" if a["delay_ms"] else str(a["status"])
    return outcome


def test_random_mix_is_reproducible_and_matches_the_probabilities(sink: Sink) -> None:
    keys = [f"rs{i}" for i in range(1000)]
    repeats = ["rs1", "rs2", "rs3"] * 3
    sink.configure(seed=42, **MIX)
    first = run_mix(sink, [keys[i : i + 125] for i in range(0, 1000, 125)], repeats)
    # Other threads, other interleaving: no decision may change, they hang on
    # (seed, key, attempt) alone.
    second = run_mix(sink, [keys[::-1][i::8] for i in range(8)], repeats)
    assert first == second
    assert len(first) == 1009
    assert any(first[(k, 1)] != first[(k, n)] for k in repeats[:3] for n in (2, 3, 4))

    counts = Counter(kind for (_, attempt), kind in first.items() if attempt == 1)
    for kind, p in [("503", 0.2), ("timeout", 0.05), ("400", 0.1), ("202", 0.25), ("200", 0.4)]:
        assert abs(counts[kind] / 1000 - p) < 0.05, (kind, counts)

    sink.configure(seed=43, **MIX)
    assert run_mix(sink, [keys[i::8] for i in range(8)], repeats) != first


def test_timeout_answers_late_without_holding_up_other_connections(sink: Sink) -> None:
    sink.configure(
        p_timeout=1.0,
        timeout_sleep_ms=800,
        rules=[{"match": {"response_id": "fast"}, "status": 200}],
    )
    outcome: list[BaseException] = []

    def slow() -> None:
        with httpx.Client(timeout=0.3) as short:
            try:
                deliver(short, sink, "slow")
            except httpx.TimeoutException as exc:
                outcome.append(exc)

    waiter = threading.Thread(target=slow)
    waiter.start()
    wait_for(lambda: len(sink.arrivals()) == 1)
    with httpx.Client(timeout=5.0) as other:
        assert deliver(other, sink, "fast").status_code == 200
    waiter.join()
    assert len(outcome) == 1 and isinstance(outcome[0], httpx.ReadTimeout)

    wait_for(lambda: sink.arrivals()[0]["t_responded"] is not None)
    slow_arrival, fast_arrival = sink.arrivals()
    assert slow_arrival["status"] == 503 and slow_arrival["delay_ms"] == 800
    assert slow_arrival["t_responded"] - slow_arrival["t_arrival"] >= 0.8
    # Served while the slow answer was still pending on its own connection.
    assert fast_arrival["t_responded"] < slow_arrival["t_responded"] - 0.3


@pytest.mark.parametrize(
    ("behaviour", "field"),
    [
        ({"colour": "red"}, "colour"),
        ({"p_async": 1.5, "orderly_url": "http://x"}, "p_async"),
        ({"p_recoverable": -0.1}, "p_recoverable"),
        ({"p_timeout": True}, "p_timeout"),
        ({"p_recoverable": 0.6, "p_non_recoverable": 0.6}, "p_non_recoverable"),
        ({"p_async": 0.1}, "orderly_url"),
        ({"orderly_url": "ftp://x"}, "orderly_url"),
        ({"ack_delay_ms": [100, 20]}, "ack_delay_ms"),
        ({"ack_delay_ms": 20}, "ack_delay_ms"),
        ({"timeout_sleep_ms": -1}, "timeout_sleep_ms"),
        ({"seed": "x"}, "seed"),
        ({"rules": {}}, "rules"),
        ({"rules": [{"match": {}, "status": 302}]}, "rules[0].status"),
        ({"rules": [{"match": {}}]}, "rules[0].status"),
        ({"rules": [{"status": 200}, {"status": 503, "times": -1}]}, "rules[1].times"),
        ({"rules": [{"match": {"request_id": "x"}, "status": 200}]}, "rules[0].match.request_id"),
        ({"rules": [{"match": {}, "status": 200, "when": 1}]}, "rules[0].when"),
        ({"rules": [{"match": {}, "status": 202}]}, "orderly_url"),
    ],
)
def test_bad_behaviour_is_refused_naming_the_field(
    sink: Sink, client: httpx.Client, behaviour: dict[str, Any], field: str
) -> None:
    before = sink.behaviour
    answer = client.put(f"{sink.base_url}/_sink/behaviour", json=behaviour)
    assert answer.status_code == 422
    (error,) = answer.json()["errors"]
    assert error["field"] == field
    with pytest.raises(BehaviourError) as raised:
        sink.configure(**behaviour)
    assert raised.value.field == field
    assert sink.behaviour == before


def test_behaviour_put_replaces_and_get_shows_it(sink: Sink, client: httpx.Client) -> None:
    answer = client.put(
        f"{sink.base_url}/_sink/behaviour",
        json={"seed": 9, "rules": [{"match": {"response_id": "x"}, "status": 400}]},
    )
    assert answer.status_code == 200
    shown = client.get(f"{sink.base_url}/_sink/behaviour").json()
    assert shown["seed"] == 9 and shown["rules"][0]["status"] == 400
    assert shown["ack_delay_ms"] == [20, 100] and shown["timeout_sleep_ms"] == 2000
    assert deliver(client, sink, "x").status_code == 400
    client.put(f"{sink.base_url}/_sink/behaviour", json={})
    assert sink.behaviour["rules"] == []
    assert deliver(client, sink, "x").status_code == 200


def test_bad_requests(sink: Sink, client: httpx.Client) -> None:
    assert client.post(sink.url, content=b"{nope").status_code == 400
    missing = client.post(sink.url, json={"conversation_id": "c", "request_id": "q"})
    assert missing.status_code == 400 and missing.json()["errors"][0]["field"] == "response_id"
    assert client.get(sink.url).status_code == 405
    assert client.get(f"{sink.base_url}/_sink/nothing").status_code == 404
    assert client.post(f"{sink.base_url}/_sink/log").status_code == 405
    bad_since = client.get(f"{sink.base_url}/_sink/log", params={"since": "x"})
    assert bad_since.status_code == 422 and bad_since.json()["errors"][0]["field"] == "since"
    assert sink.arrivals() == []


def raw_exchange(sink: Sink, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", sink.port), timeout=3) as conn:
        conn.sendall(data)
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def raw_post(response_id: str, extra: str = "") -> bytes:
    body = json.dumps(
        {"conversation_id": "c", "request_id": "q", "response_id": response_id, "payload": 1}
    ).encode()
    head = f"POST /deliver HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def test_pipelined_keep_alive_requests_and_connection_close(sink: Sink) -> None:
    reply = raw_exchange(
        sink, raw_post("a") + raw_post("b") + raw_post("c", "Connection: close\r\n")
    )
    assert reply.count(b"HTTP/1.1 200 OK") == 3
    assert reply.endswith(b"Connection: close\r\n\r\n{}")
    assert [a["key"] for a in sink.arrivals()] == ["a", "b", "c"]


def test_post_without_length_is_411_and_closed(sink: Sink) -> None:
    reply = raw_exchange(sink, b"POST /deliver HTTP/1.1\r\nHost: x\r\n\r\n{}")
    assert reply.startswith(b"HTTP/1.1 411 ")


def test_client_vanishing_mid_request_leaves_the_server_serving(
    sink: Sink, client: httpx.Client
) -> None:
    for cut in (10, 60, len(raw_post("gone")) - 3):
        with socket.create_connection(("127.0.0.1", sink.port), timeout=3) as conn:
            conn.sendall(raw_post("gone")[:cut])
    assert deliver(client, sink, "rs1").status_code == 200
    assert [a["key"] for a in sink.arrivals()] == ["rs1"]


@pytest.mark.e2e  # starts the sink's own command: a process
def test_cli_serves_until_sigterm(orderly: FakeOrderly) -> None:
    behaviour = {"rules": [{"match": {}, "status": 202}], "ack_delay_ms": [0, 0]}
    behaviour["orderly_url"] = orderly.url
    proc = subprocess.Popen(
        [sys.executable, "-m", "tooling.sink", "--port", "0", "--behaviour", json.dumps(behaviour)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("sink listening on http://127.0.0.1:"), line
        base = line.split()[-1]
        with httpx.Client(timeout=5.0) as c:
            answer = c.post(
                f"{base}/deliver",
                json={"conversation_id": "c", "request_id": "q", "response_id": "r"},
            )
            assert answer.status_code == 202
            wait_for(lambda: len(orderly.acks) == 1)
            assert orderly.paths() == [f"/acks/{answer.json()['async_response_id']}"]
            assert c.get(f"{base}/_sink/log").json()["arrivals"][0]["key"] == "r"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.e2e  # starts the sink's own command: a process
def test_cli_refuses_bad_behaviour() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tooling.sink", "--port", "0", "--behaviour", '{"p_async": 2}'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.returncode == 2 and "p_async" in done.stderr
