"""Tracked work reported done by its xid, as the seed's subscriber does (message-tracking-
timeouts: the ``:message:xid:$xid`` cross-reference names the tracking id that goes to
``:message:done``).

orderly's workers report their own work done by its tracking id. This is for whoever does a
message's work outside them and knows it by its xid: a message's msg_id, a claim's or a
drain's meta id (``orderly:track:message:xid:*``). Reported done, the timeout monitor counts
it done and never times it out. A key that owns only some source systems reports only the
messages of those, by their msg_id; another tenant's, like an unknown xid, is not found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, StringConstraints
from sqlalchemy import Engine

from orderly.worker import lua
from orderly.worker.core import owners
from orderly.worker.core.errors import NotFound
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.owners import Owns
from orderly.worker.db.queries import sql
from orderly.worker.tracking import Tracker

_MSG_ID = re.compile(r"^[1-9][0-9]{0,18}$")


class DoneIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    xid: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=255)]


@dataclass(frozen=True)
class DoneReport:
    xid: str
    track_id: int
    # DONE (reported now), ALREADY (reported done before), GONE (its tracking expired)
    outcome: str


def report_done(engine: Engine, tracker: Tracker, data: Any, owns: Owns | None) -> DoneReport:
    """Report done the tracked work ``data["xid"]`` names; NotFound when no such xid is
    tracked, or it is not the caller's (``owns``)."""
    given = parse_input(DoneIn, data)
    if owns is not None and not _owned(engine, given.xid, owns):
        raise NotFound("tracked message", given.xid)
    track_id, outcome = tracker.done_by_xid(given.xid)
    if outcome is lua.XidDone.UNKNOWN:
        raise NotFound("tracked message", given.xid)
    return DoneReport(given.xid, track_id, outcome.value)


def _owned(engine: Engine, xid: str, owns: Owns) -> bool:
    if not _MSG_ID.match(xid):
        return False  # a claim's or a drain's: not one tenant's
    with engine.connect() as conn:
        found = conn.execute(
            sql("message_show"), {"id": int(xid), "owned": owners.source_systems(owns)}
        ).first()
    return found is not None
