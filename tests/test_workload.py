"""The conversation workload's checker (tooling/workload.py) on hand-made outcomes: the order
it holds every request to, and the late requests (past MESSAGE_TTL) it reports instead."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tooling.workload import Event, Submission, Workload, check, generate, submit

TTL_MS = 1_000

# One conversation: r0 answered by s0a, s0b; r1 answered by s1a.
TURNS = {"c": [("r0", ["s0a", "s0b"]), ("r1", ["s1a"])]}
R0 = Event("request", "c", "r0")
R1 = Event("request", "c", "r1")
S0A = Event("response", "c", "r0", "s0a")
S0B = Event("response", "c", "r0", "s0b", last=True)
S1A = Event("response", "c", "r1", "s1a", last=True)


def workload(*events: Event) -> Workload:
    return Workload(TURNS, list(events))


def timed(*steps: tuple[Event, float]) -> Submission:
    """Each event sent at its time (s) and accepted 10 ms later."""
    submission = Submission()
    for event, at in steps:
        submission.sent[event] = at
        submission.accepted[event] = at + 0.01
    return submission


def arrivals(*response_ids: str, failing: str = "") -> list[dict[str, Any]]:
    request_of = {s: r for r, responses in TURNS["c"] for s in responses}
    return [
        {
            "seq": n,
            "conversation_id": "c",
            "request_id": request_of[sid],
            "response_id": sid,
            "status": 400 if sid == failing else 200,
        }
        for n, sid in enumerate(response_ids)
    ]


# r0's first response came 5 s after it: r0 had run out (MESSAGE_TTL 1 s). r1 is on time.
R0_LATE = timed((R0, 0.0), (R1, 0.1), (S1A, 0.2), (S0A, 5.0), (S0B, 5.1))
ON_TIME = timed((R0, 0.0), (R1, 0.1), (S1A, 0.2), (S0A, 0.3), (S0B, 0.4))


def test_in_order_is_ok_and_nothing_is_late() -> None:
    verdict = check(
        workload(R0, R1, S1A, S0A, S0B),
        arrivals("s0a", "s0b", "s1a"),
        submission=ON_TIME,
        message_ttl_ms=TTL_MS,
    )
    assert verdict.ok and verdict.late == [] and verdict.delivered == 3


def test_a_late_requests_responses_may_come_after_a_later_requests() -> None:
    got = arrivals("s1a", "s0a", "s0b")
    late = check(workload(), got, submission=R0_LATE, message_ttl_ms=TTL_MS)
    assert late.ok, late.violations
    assert late.late == ["r0"]  # reported, not hidden
    # The same arrivals for requests answered in time break the order.
    on_time = check(workload(), got, submission=ON_TIME, message_ttl_ms=TTL_MS)
    assert not on_time.ok and on_time.late == []
    assert on_time.violations == ["c: s1a before s0a", "c: s1a before s0b"]
    # Without the submission's times nothing is taken as late.
    assert check(workload(), got).violations == on_time.violations


def test_responses_orderly_marked_late_excuse_their_request_only() -> None:
    got = arrivals("s1a", "s0a", "s0b")
    # orderly saw r0 expire and marked its responses late: reported apart, not a violation.
    marked = check(workload(), got, submission=ON_TIME, message_ttl_ms=TTL_MS, marked_late=["s0a"])
    assert marked.ok, marked.violations
    assert marked.marked_late == ["s0a"] and marked.late == ["r0"]
    # Marking r1's response late excuses nothing for r0: its responses still came too late.
    other = check(workload(), got, submission=ON_TIME, message_ttl_ms=TTL_MS, marked_late=["s1a"])
    assert not other.ok and other.violations == ["c: s1a before s0a", "c: s1a before s0b"]


def test_a_late_request_keeps_its_own_order_and_its_deliveries() -> None:
    swapped = check(
        workload(), arrivals("s1a", "s0b", "s0a"), submission=R0_LATE, message_ttl_ms=TTL_MS
    )
    assert swapped.order_violations == 1 and swapped.violations == ["c: s0b before s0a"]
    lost = check(workload(), arrivals("s1a", "s0a"), submission=R0_LATE, message_ttl_ms=TTL_MS)
    assert lost.missing == ["s0b"] and not lost.ok


def test_a_late_request_never_overtakes_an_earlier_one() -> None:
    # r1 late (answered 5 s after it), yet delivered before r0's responses: not allowed.
    r1_late = timed((R0, 0.0), (R1, 0.1), (S0A, 0.2), (S0B, 0.3), (S1A, 5.2))
    verdict = check(
        workload(), arrivals("s1a", "s0a", "s0b"), submission=r1_late, message_ttl_ms=TTL_MS
    )
    assert verdict.late == ["r1"]
    assert verdict.violations == ["c: s1a before s0a", "c: s1a before s0b"]


def test_a_gap_between_two_responses_makes_a_request_late_too() -> None:
    # Each response renews the request's life: s0b came 5 s after s0a.
    gap = timed((R0, 0.0), (S0A, 0.1), (R1, 0.2), (S1A, 0.3), (S0B, 5.1))
    assert gap.late_requests(TTL_MS) == {"r0"}
    assert ON_TIME.late_requests(TTL_MS) == set()
    # What counts is the longest the gap can have been: accepted minus sent.
    edge = timed((R0, 0.0), (S0A, 0.985), (S0B, 1.0), (R1, 1.1), (S1A, 1.2))
    assert edge.late_requests(TTL_MS) == set()  # 0.995 s
    assert timed((R0, 0.0), (S0A, 0.995)).late_requests(TTL_MS) == {"r0"}  # 1.005 s


def test_the_ttl_is_needed_with_a_submission() -> None:
    with pytest.raises(ValueError, match="message_ttl_ms"):
        check(workload(), arrivals("s0a"), submission=ON_TIME)


def test_a_cancelled_group_of_a_late_request_is_not_missing() -> None:
    verdict = check(
        workload(),
        arrivals("s1a", "s0a", failing="s0a"),
        submission=R0_LATE,
        message_ttl_ms=TTL_MS,
    )
    assert verdict.ok and verdict.cancelled_groups == 1 and verdict.cancelled_responses == 2


def test_submit_records_when_each_event_went_out_and_was_accepted() -> None:
    posted: list[tuple[str, dict[str, Any]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        posted.append((request.url.path, json.loads(request.content)))
        return httpx.Response(201, json={})

    load = generate(seed=3, conversations=3)
    with httpx.Client(transport=httpx.MockTransport(answer), base_url="http://x") as client:
        submission = submit(load, client, "chat")
    assert list(submission.sent) == load.events == list(submission.accepted)
    times = [t for e in load.events for t in (submission.sent[e], submission.accepted[e])]
    assert times == sorted(times)
    assert submission.duration_s == times[-1] - times[0]
    assert [path.rsplit("/", 1)[1] for path, _ in posted] == [
        "requests" if e.kind == "request" else "responses" for e in load.events
    ]

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"errors": []})

    with (
        httpx.Client(transport=httpx.MockTransport(refuse), base_url="http://x") as client,
        pytest.raises(RuntimeError, match="422"),
    ):
        submit(load, client, "chat")
