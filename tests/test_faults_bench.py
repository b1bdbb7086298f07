"""The fault-injection benchmark's accounting over a sink log (benchmarks/faults.py)."""

from __future__ import annotations

from typing import Any

from benchmarks.faults import (
    ROOM,
    duplicates,
    late_responses,
    lost_responses,
    order_violations,
    recovery,
)


def arrival(
    seq: int, sid: str, status: int = 200, *, late: str | None = None, key: str | None = None
) -> dict[str, Any]:
    cid, rid = sid.split("-")[0], "-".join(sid.split("-")[:2])
    return {
        "seq": seq,
        "conversation_id": cid,
        "request_id": rid,
        "response_id": sid,
        "key": key or sid,
        "status": status,
        "late": late,
    }


def push(seq: int, routing_key: str, key: str, status: int = 200) -> dict[str, Any]:
    return {
        "seq": seq,
        "conversation_id": ROOM,
        "request_id": routing_key,
        "response_id": key,
        "key": key,
        "status": status,
        "late": None,
    }


TURNS = {"c1": [("c1-r0", ["c1-r0-s0", "c1-r0-s1"]), ("c1-r1", ["c1-r1-s0"])]}


def test_order_counts_first_deliveries_only_and_leaves_late_ones_out() -> None:
    in_order = [arrival(1, "c1-r0-s0"), arrival(2, "c1-r0-s1"), arrival(3, "c1-r1-s0")]
    assert order_violations(TURNS, in_order) == []
    # A failed try and a redelivery of an earlier response are not violations.
    retried = [
        arrival(1, "c1-r0-s0", 503),
        arrival(2, "c1-r0-s0"),
        arrival(3, "c1-r0-s1"),
        arrival(4, "c1-r0-s0"),
        arrival(5, "c1-r1-s0"),
    ]
    assert order_violations(TURNS, retried) == []
    swapped = [arrival(1, "c1-r0-s0"), arrival(2, "c1-r1-s0"), arrival(3, "c1-r0-s1")]
    assert order_violations(TURNS, swapped) == ["c1: c1-r1-s0 before c1-r0-s1"]
    late = [arrival(1, "c1-r0-s0"), arrival(2, "c1-r1-s0"), arrival(3, "c1-r0-s1", late="true")]
    assert order_violations(TURNS, late) == []
    assert late_responses(late) == 1


def test_duplicates_are_split_by_idempotency_key() -> None:
    log = [
        arrival(1, "c1-r0-s0", 202),
        arrival(2, "c1-r0-s0"),  # delivered again, same key
        push(3, "ev.1", "corr-a:1"),
        push(4, "ev.1", "corr-a:1", 503),  # a failure is no delivery
        push(5, "ev.1", "corr-b:1"),  # the same event published twice
        push(6, "ev.2", "corr-c:1"),
    ]
    assert duplicates(log) == (1, 1)


def test_lost_responses_leave_out_groups_the_client_refused() -> None:
    accepted = {"c1-r0-s0": "c1-r0", "c1-r0-s1": "c1-r0", "c1-r1-s0": "c1-r1"}
    log = [arrival(1, "c1-r0-s0", 400), arrival(2, "c1-r1-s0", 503)]
    lost, after_cancel = lost_responses(accepted, log)
    assert lost == ["c1-r1-s0"]
    assert after_cancel == []
    lost, after_cancel = lost_responses(accepted, [*log, arrival(3, "c1-r0-s1")])
    assert after_cancel == ["c1-r0-s1"]


def test_recovery_is_the_first_reading_after_the_fault_above_the_one_before_it() -> None:
    samples = [
        (9.0, {"messages": 5, "conversations": 5, "pushes": 5}),
        (10.1, {"messages": 6, "conversations": 5, "pushes": 5}),
        (10.2, {"messages": 6, "conversations": 5, "pushes": 7}),
        (11.5, {"messages": 7, "conversations": 5, "pushes": 7}),
    ]
    got = recovery(samples, 9.0, 10.0)
    assert got["conversations"] is None
    assert got["messages"] is not None and abs(got["messages"] - 0.1) < 1e-9
    assert got["pushes"] is not None and abs(got["pushes"] - 0.2) < 1e-9
    assert recovery(samples, 8.0, 10.0) == dict.fromkeys(("messages", "conversations", "pushes"))
