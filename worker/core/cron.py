"""Cron expressions read in a time zone: when a schedule is due (the ``cronsim`` library).

Five fields, ``minute hour day-of-month month day-of-week``, as Debian's cron reads them
(names such as ``MON`` and ``JAN``, ``*/15``, ranges and lists, ``L`` for a month's last day).
Daylight saving time follows the time zone, the way Debian's cron handles it:

- an expression at fixed times (neither minute nor hour begins with ``*``, e.g. ``30 2 * * *``)
  runs once a local day: a time the clocks skip (02:30 on the night they go forward) runs at
  the first local time after the gap (03:00); a time that occurs twice (the night they go
  back) runs at its first occurrence only;
- any other (``*/15 * * * *``, ``0 * * * *``) runs at every matching local time as it
  happens: every 15 minutes of real time, the repeated hour included, the skipped one not.

Every instant is returned as an aware UTC datetime at a whole minute.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from orderly.worker.core.errors import InvalidMessage

FIELDS = 5
# Steps past instants a time zone's repeated hour yields before the one sought (two at most),
# and past due instants a catch-up walks after its jump back (one or two): bounds, not
# expected counts.
MAX_STEPS = 100


@dataclass(frozen=True)
class Cron:
    """A checked expression in its time zone (:func:`parse`)."""

    expression: str
    zone: ZoneInfo

    def next_after(self, after: datetime) -> datetime:
        """The first due instant strictly after ``after``."""
        found = CronSim(self.expression, after.astimezone(self.zone))
        try:
            for _ in range(MAX_STEPS):
                instant = next(found).astimezone(UTC)
                # A fixed-time expression walks local wall times: in a repeated hour it may
                # yield the first occurrence of a time already past.
                if instant > after:
                    return instant
        except StopIteration:
            pass
        raise InvalidMessage("cron", f"{self.expression!r} is never due after {after.isoformat()}")

    def latest_due(self, next_at: datetime, now: datetime) -> datetime:
        """The latest due instant from ``next_at`` up to ``now`` (``next_at`` <= ``now``):
        what a schedule produces after missing instants (catch-up: one). A jump back from
        ``now`` finds it without walking every instant missed."""
        # Reverse iteration steps back a second first: start a second past now, whole.
        start = (now.replace(microsecond=0) + timedelta(seconds=1)).astimezone(self.zone)
        try:
            back = next(CronSim(self.expression, start, reverse=True)).astimezone(UTC)
        except StopIteration:
            back = next_at
        instant = back if next_at < back <= now else next_at
        for _ in range(MAX_STEPS):
            following = self.next_after(instant)
            if following > now:
                break
            instant = following
        return instant


def zone(name: str) -> ZoneInfo:
    """An IANA time zone by name; InvalidMessage naming ``time_zone`` when there is none."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidMessage(
            "time_zone", f"unknown time zone {name!r} (an IANA name, e.g. Europe/Berlin or UTC)"
        ) from None


def expression(text: str) -> str:
    """A five-field expression with single spaces; InvalidMessage naming ``cron``."""
    fields = text.split()
    if len(fields) != FIELDS:
        raise InvalidMessage(
            "cron",
            f"{text!r} has {len(fields)} field{'' if len(fields) == 1 else 's'}; give five: "
            "minute hour day-of-month month day-of-week (e.g. '0 6 * * MON-FRI')",
        )
    normal = " ".join(fields)
    try:
        CronSim(normal, datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError as exc:
        raise InvalidMessage("cron", f"{text!r}: {str(exc).lower() or 'invalid'}") from None
    return normal


def parse(cron: str, time_zone: str) -> Cron:
    """Both checked; every problem named (``cron``, ``time_zone``) before any is raised."""
    problems: list[tuple[str, str]] = []
    checked_expression = checked_zone = None
    try:
        checked_expression = expression(cron)
    except InvalidMessage as exc:
        problems += exc.problems
    try:
        checked_zone = zone(time_zone)
    except InvalidMessage as exc:
        problems += exc.problems
    if checked_expression is None or checked_zone is None:
        raise InvalidMessage(*problems[0], *problems[1:])
    return Cron(checked_expression, checked_zone)


def iso(instant: datetime) -> str:
    """An instant as ISO 8601 in UTC, to the second: ``2026-03-29T01:00:00Z``."""
    return instant.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
