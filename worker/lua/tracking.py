"""The calls of message tracking's scripts (track_*.lua) and of the service lifecycle's
(service_*.lua), made by worker.tracking."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orderly.worker.core.scripts import Call, Scripts, as_text


def track_register(
    scripts: Scripts,
    *,
    id_counter: str,
    ids: str,
    overflow_metrics: str,
    message_prefix: str,
    xid_prefix: str,
    capacity: int,
    now_ms: int,
    timeout_ms: int,
    expire_ms: int,
    xid: str,
    xid_type: str,
    service: str,
    kind: str,
    claim: str,
) -> int:
    """The new tracking id; 0 when the tracked ids are at capacity (only counted)."""
    call = Call(
        "track_register",
        keys=(id_counter, ids, overflow_metrics),
        args=(
            message_prefix,
            xid_prefix,
            capacity,
            now_ms,
            timeout_ms,
            expire_ms,
            xid,
            xid_type,
            service,
            kind,
            claim,
        ),
    )
    return int(scripts.run(call))


def track_done(scripts: Scripts, *, message: str, done: str, track_id: int, now_ms: int) -> bool:
    """Whether the id was pushed to the done list (False: its hash is gone, or it was
    reported already)."""
    return bool(scripts.run(Call("track_done", keys=(message, done), args=(track_id, now_ms))))


class XidDone(enum.StrEnum):
    DONE = "DONE"  # reported now
    ALREADY = "ALREADY"  # reported done before
    GONE = "GONE"  # its hash expired
    UNKNOWN = "UNKNOWN"  # no such xid (or it expired)


def track_done_xid(
    scripts: Scripts, *, xid_key: str, done: str, message_prefix: str, now_ms: int
) -> tuple[int, XidDone]:
    """Report the work the xid names done: its tracking id (0 when unknown) and what became
    of the report."""
    found = scripts.run(Call("track_done_xid", keys=(xid_key, done), args=(message_prefix, now_ms)))
    return int(found[0]), XidDone(as_text(found[1]))


@dataclass(frozen=True)
class TimedOut:
    track_id: int
    xid: str
    kind: str
    claim: str  # which claim of the message timed out ('' for other kinds)
    elapsed_ms: int


@dataclass(frozen=True)
class MonitorTurn:
    done: int
    expired: int
    timed_out: list[TimedOut]


def track_monitor(
    scripts: Scripts,
    *,
    done: str,
    ids: str,
    done_metrics: str,
    timeout_metrics: str,
    expired_metrics: str,
    message_prefix: str,
    now_ms: int,
    batch: int,
    bucket_bounds_ms: Sequence[int],
) -> MonitorTurn:
    """One turn of the timeout monitor: done ids counted, expired ones delisted, timeouts."""
    call = Call(
        "track_monitor",
        keys=(done, ids, done_metrics, timeout_metrics, expired_metrics),
        args=(message_prefix, now_ms, batch, *bucket_bounds_ms),
    )
    counted, expired, raw = scripts.run(call)
    timed_out = [
        TimedOut(
            track_id=int(item[0]),
            xid=as_text(item[1]),
            kind=as_text(item[2]),
            claim=as_text(item[3]),
            elapsed_ms=int(item[4]),
        )
        for item in raw
    ]
    return MonitorTurn(done=int(counted), expired=int(expired), timed_out=timed_out)


def _pairs(fields: Mapping[str, str | int]) -> list[str | int]:
    pairs: list[str | int] = []
    for name, value in fields.items():
        pairs += [name, value]
    return pairs


def service_register(
    scripts: Scripts,
    *,
    id_counter: str,
    ids: str,
    service_prefix: str,
    expire_ms: int,
    fields: Mapping[str, str | int],
) -> int:
    """The new service id (its hash expiring); refused (TrackingError) when the id's key
    exists already."""
    call = Call(
        "service_register",
        keys=(id_counter, ids),
        args=(service_prefix, expire_ms, *_pairs(fields)),
    )
    return int(scripts.run(call))


class Renewal(enum.StrEnum):
    RENEWED = "renewed"
    REMOVED = "removed"  # the key is gone, its mark is there: an operator removed it
    LOST = "lost"  # both are gone: Redis lost its data


def service_renew(
    scripts: Scripts, *, service: str, mark: str, expire_ms: int, now_ms: int, mark_life_ms: int
) -> Renewal:
    call = Call("service_renew", keys=(service, mark), args=(expire_ms, now_ms, mark_life_ms))
    renewed = int(scripts.run(call))
    return {1: Renewal.RENEWED, 0: Renewal.REMOVED}.get(renewed, Renewal.LOST)


def service_restore(
    scripts: Scripts,
    *,
    service: str,
    ids: str,
    id_counter: str,
    service_id: int,
    expire_ms: int,
    fields: Mapping[str, str | int],
) -> bool:
    """Whether the key was put back (False: it exists, nothing changed)."""
    call = Call(
        "service_restore",
        keys=(service, ids, id_counter),
        args=(service_id, expire_ms, *_pairs(fields)),
    )
    return bool(scripts.run(call))
