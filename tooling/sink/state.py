"""What the sink records (arrivals, decisions, deliveries per conversation) and the ACKs it
sends back to orderly from a few threads."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from tooling.sink.behaviour import Behaviour

log = logging.getLogger("orderly.sink")

ACK_ATTEMPTS = 3
ACK_TIMEOUT_S = 5.0


@dataclass(slots=True)
class _Arrival:
    seq: int
    t_arrival: float
    conversation_id: str
    request_id: str
    response_id: str
    key: str
    attempt: int
    status: int
    duplicate: bool
    # How long the answer was held back on purpose (a timeout, a rule's delay_ms).
    delay_ms: float = 0.0
    async_response_id: str | None = None
    t_responded: float | None = None
    ack_status: int | None = None
    t_ack: float | None = None
    # orderly's X-Orderly-Late and X-Orderly-Late-By-Ms headers, as received (None: absent).
    late: str | None = None
    late_by_ms: str | None = None
    # X-Orderly-Ack-Token as received: the ACK brings it back.
    ack_token: str | None = None
    # The delivered body's payload, as received.
    payload: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "t_arrival": self.t_arrival,
            "t_responded": self.t_responded,
            "conversation_id": self.conversation_id,
            "request_id": self.request_id,
            "response_id": self.response_id,
            "key": self.key,
            "attempt": self.attempt,
            "status": self.status,
            "async_response_id": self.async_response_id,
            "ack_status": self.ack_status,
            "t_ack": self.t_ack,
            "duplicate": self.duplicate,
            "delay_ms": self.delay_ms,
            "late": self.late,
            "late_by_ms": self.late_by_ms,
            "ack_token": self.ack_token,
            "payload": self.payload,
        }


@dataclass(frozen=True, slots=True)
class _Decision:
    status: int
    delay_s: float = 0.0
    # Seconds after the 202 is written; None: no ACK will be sent.
    ack_delay_s: float | None = None
    ack_url: str | None = None


_ANSWER_200 = _Decision(200)


class _State:
    """Log, per-key state and behaviour; shared by the event loop and the ACK threads."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.lock = threading.Lock()
        self.behaviour = behaviour
        self._rule_left: list[int | None] = [rule.times for rule in behaviour.rules]
        self.log: list[_Arrival] = []
        self._attempts: dict[str, int] = {}
        self._delivered: set[str] = set()
        self._deliveries: dict[str, list[str]] = {}

    def configure(self, behaviour: Behaviour) -> None:
        with self.lock:
            self.behaviour = behaviour
            self._rule_left = [rule.times for rule in behaviour.rules]

    def reset(self) -> None:
        with self.lock:
            self.log = []
            self._attempts.clear()
            self._delivered.clear()
            self._deliveries.clear()
            # The rules' counts are about arrivals being forgotten here: they start over too.
            self._rule_left = [rule.times for rule in self.behaviour.rules]

    def arrive(
        self,
        conversation_id: str,
        request_id: str,
        response_id: str,
        key: str,
        t: float,
        headers: dict[str, str] | None = None,
        payload: Any = None,
    ) -> tuple[_Arrival, _Decision]:
        with self.lock:
            attempt = self._attempts.get(key, 0) + 1
            self._attempts[key] = attempt
            decision = self._decide(conversation_id, response_id, key, attempt)
            duplicate = key in self._delivered
            arrival = _Arrival(
                seq=len(self.log) + 1,
                t_arrival=t,
                conversation_id=conversation_id,
                request_id=request_id,
                response_id=response_id,
                key=key,
                attempt=attempt,
                status=decision.status,
                duplicate=duplicate,
                delay_ms=decision.delay_s * 1000,
                late=(headers or {}).get("x-orderly-late"),
                late_by_ms=(headers or {}).get("x-orderly-late-by-ms"),
                ack_token=(headers or {}).get("x-orderly-ack-token"),
                payload=payload,
            )
            if decision.status == 202:
                arrival.async_response_id = uuid.uuid4().hex
            if decision.status in (200, 202) and not duplicate:
                self._delivered.add(key)
                self._deliveries.setdefault(conversation_id, []).append(response_id)
            self.log.append(arrival)
            return arrival, decision

    def _decide(self, conversation_id: str, response_id: str, key: str, attempt: int) -> _Decision:
        b = self.behaviour
        for i, rule in enumerate(b.rules):
            if not rule.matches(conversation_id, response_id):
                continue
            left = self._rule_left[i]
            if left is not None:
                if left <= 0:
                    continue
                self._rule_left[i] = left - 1
            ack_delay = None
            if rule.status == 202 and not rule.never_ack:
                ack_delay = self._ack_delay(b, random.Random(f"{b.seed}:{key}:{attempt}"))
            return _Decision(rule.status, rule.delay_ms / 1000, ack_delay, b.orderly_url)
        if not (b.p_recoverable or b.p_timeout or b.p_non_recoverable or b.p_async):
            return _ANSWER_200
        # One generator per (seed, key, attempt): the decision does not depend on which other
        # arrivals happened first, so concurrent runs reproduce it.
        rng = random.Random(f"{b.seed}:{key}:{attempt}")
        u = rng.random()
        edge = b.p_recoverable
        if u < edge:
            return _Decision(503)
        edge += b.p_timeout
        if u < edge:
            return _Decision(503, b.timeout_sleep_ms / 1000)
        edge += b.p_non_recoverable
        if u < edge:
            return _Decision(400)
        edge += b.p_async
        if u < edge:
            never = rng.random() < b.p_never_ack
            delay = self._ack_delay(b, rng)
            return _Decision(202, 0.0, None if never else delay, b.orderly_url)
        return _ANSWER_200

    @staticmethod
    def _ack_delay(b: Behaviour, rng: random.Random) -> float:
        low, high = b.ack_delay_ms
        return rng.uniform(low, high) / 1000

    def record_ack(self, arrival: _Arrival, status: int, t_sent: float) -> None:
        with self.lock:
            arrival.ack_status = status
            arrival.t_ack = t_sent

    def arrivals(self, since: int = 0) -> list[dict[str, Any]]:
        with self.lock:
            # seq is the 1-based position in the log, so the tail after ``since`` is a slice.
            return [a.as_dict() for a in self.log[max(since, 0) :]]

    def deliveries(self) -> dict[str, list[str]]:
        with self.lock:
            return {cid: list(ids) for cid, ids in self._deliveries.items()}


class _AckSender:
    """Sends the delayed ACKs from a few threads, so slow ACKs never stall the event loop."""

    def __init__(self, state: _State, workers: int) -> None:
        self._state = state
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sink-ack")
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._clients_lock = threading.Lock()

    def submit(self, arrival: _Arrival, base_url: str) -> None:
        with contextlib.suppress(RuntimeError):  # shut down: the pending ACK is dropped
            self._pool.submit(self._send, arrival, base_url)

    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(timeout=ACK_TIMEOUT_S)
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    def _send(self, arrival: _Arrival, base_url: str) -> None:
        url = f"{base_url}/acks/{arrival.async_response_id}"
        status = 0
        t_sent = time.time()
        for attempt in range(1, ACK_ATTEMPTS + 1):
            t_sent = time.time()
            try:
                headers = {"X-Orderly-Ack-Token": arrival.ack_token or ""}
                status = self._client().post(url, headers=headers).status_code
                break
            except httpx.HTTPError as exc:
                # Only a missing answer is retried: an HTTP status is orderly's verdict.
                log.warning("ACK %s attempt %d failed: %s", url, attempt, exc)
                if attempt < ACK_ATTEMPTS:
                    time.sleep(0.1 * attempt)
        self._state.record_ack(arrival, status, t_sent)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._clients_lock:
            for client in self._clients:
                client.close()
            self._clients.clear()
