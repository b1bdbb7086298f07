"""A seeded conversation workload, its submission over HTTP, and the check of its outcome.

Used by the end-to-end tests, the main job and the benchmark. Conversations have 1-5
requests of 1-4 responses; requests are registered in order, and responses are submitted
shuffled across and within conversations: each after its request, and in order within its
request (arrival is what orders the responses of one request).

A request lives MESSAGE_TTL past its registration or its latest response. One whose next
response comes later than that has run out: that response registers it again as a callback,
at the end of its conversation, so its responses may come after those of later requests
(the seed's rule). ``submit`` records when each event went out and was accepted, and
``check`` reports such requests as late instead of counting their moves as order violations.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

# What the sink's non-recoverable answers are (the sender's classification: other 4xx).
RECOVERABLE_4XX = frozenset({408, 425, 429})


@dataclass(frozen=True)
class Event:
    kind: str  # "request" or "response"
    conversation_id: str
    request_id: str
    response_id: str = ""
    last: bool = False


@dataclass
class Workload:
    # conversation -> its requests in order, each with its responses in order
    turns: dict[str, list[tuple[str, list[str]]]]
    events: list[Event]

    @property
    def responses(self) -> int:
        return sum(len(r) for turns in self.turns.values() for _, r in turns)

    @property
    def requests(self) -> int:
        return sum(len(t) for t in self.turns.values())


def generate(
    seed: int,
    conversations: int,
    prefix: str = "",
    *,
    requests: tuple[int, int] = (1, 5),
    responses: tuple[int, int] = (1, 4),
) -> Workload:
    rng = random.Random(seed)
    turns: dict[str, list[tuple[str, list[str]]]] = {}
    for c in range(conversations):
        cid = f"{prefix}c{c}"
        turns[cid] = [
            (f"{cid}-r{r}", [f"{cid}-r{r}-s{s}" for s in range(rng.randint(*responses))])
            for r in range(rng.randint(*requests))
        ]
    # Per conversation: the next request to register, and each registered request's next
    # response. A random conversation moves one step at a time.
    next_request = dict.fromkeys(turns, 0)
    open_requests: dict[str, list[list[Any]]] = {cid: [] for cid in turns}
    events: list[Event] = []
    active = list(turns)
    while active:
        cid = rng.choice(active)
        choices = [o for o in open_requests[cid] if o[1] < len(o[2])]
        can_register = next_request[cid] < len(turns[cid])
        if can_register and (not choices or rng.random() < 0.3):
            rid, resp = turns[cid][next_request[cid]]
            next_request[cid] += 1
            events.append(Event("request", cid, rid))
            open_requests[cid].append([rid, 0, resp])
        elif choices:
            entry = rng.choice(choices)
            rid, i, resp = entry
            entry[1] = i + 1
            events.append(Event("response", cid, rid, resp[i], last=i == len(resp) - 1))
        else:
            active.remove(cid)
    return Workload(turns, events)


@dataclass
class Submission:
    """When each event was sent and when orderly had accepted it (``time.monotonic()``)."""

    sent: dict[Event, float] = field(default_factory=dict)
    accepted: dict[Event, float] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        if not self.sent:
            return 0.0
        return max(self.accepted.values()) - min(self.sent.values())

    def late_requests(self, message_ttl_ms: float) -> set[str]:
        """Requests that may have run out before their next response came.

        orderly stored each event at some moment between its sending and its acceptance: a
        gap is at most the later event's acceptance minus the earlier one's sending. A
        request is late when that exceeds MESSAGE_TTL for its first response or between two
        of its responses (each response renews the request's life).
        """
        previous: dict[str, Event] = {}
        late: set[str] = set()
        for event in self.sent:  # in submission order
            before = previous.get(event.request_id)
            if (
                before is not None
                and event in self.accepted
                and (self.accepted[event] - self.sent[before]) * 1000 > message_ttl_ms
            ):
                late.add(event.request_id)
            previous[event.request_id] = event
        return late


def submit(
    workload: Workload,
    client: httpx.Client,
    origin: str,
    on_event: Callable[[Event], None] | None = None,
) -> Submission:
    """POST every event in order; any answer other than 201/200 is an error."""
    submission = Submission()
    for event in workload.events:
        submission.sent[event] = time.monotonic()
        if event.kind == "request":
            answer = client.post(
                f"/conversations/{event.conversation_id}/requests",
                json={"request_id": event.request_id, "origin": origin},
            )
        else:
            answer = client.post(
                f"/conversations/{event.conversation_id}/responses",
                json={
                    "request_id": event.request_id,
                    "response_id": event.response_id,
                    "payload": {"text": f"answer {event.response_id}"},
                    "last": event.last,
                },
            )
        if answer.status_code not in (200, 201):
            raise RuntimeError(f"{event}: {answer.status_code} {answer.text}")
        submission.accepted[event] = time.monotonic()
        if on_event is not None:
            on_event(event)
    return submission


@dataclass
class Verdict:
    delivered: int = 0  # responses delivered (first successful arrival)
    duplicates: int = 0  # further successful arrivals of a delivered response
    retried: int = 0  # arrivals that were a second or later try of a response
    cancelled_groups: int = 0
    cancelled_responses: int = 0
    order_violations: int = 0  # POSTs (failed ones too) after a later one of their conversation
    violations: list[str] = field(default_factory=list)  # "conversation: a before b"
    missing: list[str] = field(default_factory=list)  # should have been delivered, were not
    after_cancel: list[str] = field(default_factory=list)  # delivered after their group failed
    mismatches: list[str] = field(default_factory=list)  # PostgreSQL disagrees with the sink
    # Requests answered after their MESSAGE_TTL (see Submission.late_requests), or with a
    # response orderly itself marked late: their responses may come after later requests'
    # ones, in order among themselves, and are still due.
    late: list[str] = field(default_factory=list)
    # The responses orderly marked late (``message.late_ms``, the X-Orderly-Late header).
    marked_late: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.order_violations or self.missing or self.after_cancel or self.mismatches)


def _success(status: int) -> bool:
    return 200 <= status < 300


def _fatal(status: int) -> bool:
    return 400 <= status < 500 and status not in RECOVERABLE_4XX


def check(
    workload: Workload,
    arrivals: Iterable[Mapping[str, Any]],
    pg_states: Mapping[str, str] | None = None,
    *,
    submission: Submission | None = None,
    message_ttl_ms: float | None = None,
    marked_late: Iterable[str] = (),
) -> Verdict:
    """Compare what the sink received (and what PostgreSQL says) with what was due.

    Given the ``submission`` and the MESSAGE_TTL orderly ran with, requests answered too late
    are reported in ``late``; so are the requests of the responses orderly ``marked_late``
    itself (it saw their request expire). Without either every request is held to its
    conversation order.
    """
    verdict = Verdict()
    late: set[str] = set()
    if submission is not None:
        if message_ttl_ms is None:
            raise ValueError("message_ttl_ms is needed to tell late requests")
        late = submission.late_requests(message_ttl_ms)
    request_of_response = {
        sid: rid for turns in workload.turns.values() for rid, r in turns for sid in r
    }
    verdict.marked_late = sorted(set(marked_late))
    late |= {request_of_response[sid] for sid in verdict.marked_late if sid in request_of_response}
    verdict.late = sorted(late)
    first_success: dict[str, int] = {}
    failed_at: dict[str, str] = {}  # request -> its response that got a fatal answer
    seen: set[str] = set()
    posted: dict[str, list[str]] = {}  # every arrival, in order, per conversation
    for a in sorted(arrivals, key=lambda a: int(a["seq"])):
        rid, sid, status = a["request_id"], a["response_id"], int(a["status"])
        posted.setdefault(a["conversation_id"], []).append(sid)
        if sid in seen:
            verdict.retried += 1
        seen.add(sid)
        if _success(status):
            if sid in first_success:
                verdict.duplicates += 1
                continue
            first_success[sid] = int(a["seq"])
        elif _fatal(status) and rid not in failed_at:
            failed_at[rid] = sid
    verdict.delivered = len(first_success)
    verdict.cancelled_groups = len(failed_at)

    for cid, turns in workload.turns.items():
        expected: list[str] = []
        # Every POST the client saw, failed ones too, must come in conversation order:
        # a position never goes back (a retry repeats its own). A late request's responses
        # are held to their own order only: they may come after a later request's.
        position = {sid: i for i, sid in enumerate(s for _, r in turns for s in r)}
        request_of = {sid: rid for rid, r in turns for sid in r}
        furthest: str | None = None  # the furthest response posted so far
        furthest_of: dict[str, str] = {}  # the same, per request
        for sid in (s for s in posted.get(cid, []) if s in position):
            rid = request_of[sid]
            bound = furthest_of.get(rid) if rid in late else furthest
            if bound is not None and position[bound] > position[sid]:
                verdict.order_violations += 1
                verdict.violations.append(f"{cid}: {bound} before {sid}")
            if furthest is None or position[sid] > position[furthest]:
                furthest = sid
            if rid not in furthest_of or position[sid] > position[furthest_of[rid]]:
                furthest_of[rid] = sid
        for rid, responses in turns:
            cut = responses.index(failed_at[rid]) if rid in failed_at else len(responses)
            expected += responses[:cut]
            for sid in responses[cut:]:
                verdict.cancelled_responses += 1
                if sid in first_success:
                    verdict.after_cancel.append(sid)
                if pg_states is not None and pg_states.get(sid) != "CANCEL":
                    verdict.mismatches.append(f"{sid}: {pg_states.get(sid)}, expected CANCEL")
            if pg_states is not None:
                want = "CANCEL" if rid in failed_at else "OK"
                if pg_states.get(rid) != want:
                    verdict.mismatches.append(f"{rid}: {pg_states.get(rid)}, expected {want}")
        for sid in expected:
            if sid not in first_success:
                verdict.missing.append(sid)
            if pg_states is not None and sid in first_success and pg_states.get(sid) != "OK":
                verdict.mismatches.append(f"{sid}: {pg_states.get(sid)}, delivered")
    return verdict
