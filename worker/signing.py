"""The secrets orderly signs its outbound requests with, one per destination (table
``signing_secret``): a channel (its origin), a PUSH subscription (its id), a source system
(its confirmations, and the external calls its messages' handlers make). A destination's
secret is made the first time a request goes there; a rotation makes a new one and keeps
signing with the previous one too for a while, so that a receiver can switch without losing
a request. The scheme is the Standard Webhooks one (orderly.client.webhooks), which a
receiver checks with :func:`orderly.client.webhooks.verify`.

Senders read a destination's secrets through a short cache (``CACHE_S``): a rotation shows
within that long, and the previous secret stays valid longer than that.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt
from sqlalchemy import Engine

from orderly.client.webhooks import new_secret
from orderly.models import SIGNING_KINDS
from orderly.worker.core import owners
from orderly.worker.core.clock import SYSTEM, Clock
from orderly.worker.core.errors import InvalidMessage, NotFound
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.owners import Owns
from orderly.worker.db.queries import sql

# How long a sender keeps a destination's secrets before reading them again.
CACHE_S = 10.0
# How long a rotated-out secret is still signed with, unless told otherwise.
KEEP_PREVIOUS_S = 86_400


@dataclass(frozen=True)
class Secrets:
    """A destination's signing secrets: the current one, and the previous one until
    ``previous_until`` (None: none)."""

    kind: str
    name: str
    secret: str
    previous: str | None
    previous_until: datetime | None
    rotated_at: datetime | None

    def signing(self, now: datetime) -> list[str]:
        """The secrets a request sent at ``now`` is signed with."""
        if self.previous is not None and self.previous_until and now < self.previous_until:
            return [self.secret, self.previous]
        return [self.secret]

    def view(self) -> dict[str, Any]:
        """As the API and the CLI show it."""
        until = self.previous_until
        return {
            "kind": self.kind,
            "name": self.name,
            "secret": self.secret,
            "previous": self.previous,
            "previous_until": None if until is None else until.isoformat(),
        }


def _checked(kind: str, name: str) -> None:
    if kind not in SIGNING_KINDS:
        raise InvalidMessage("kind", f"must be one of {', '.join(SIGNING_KINDS)}")
    if not 1 <= len(name) <= 200:
        raise InvalidMessage("name", "must be 1 to 200 characters")


class RotateIn(BaseModel):
    """A rotation: how long the secret before it still signs (0: no longer; 30 days at most)."""

    model_config = ConfigDict(extra="forbid")

    keep_previous_s: Annotated[StrictInt, Field(ge=0, le=30 * 86_400)] = KEEP_PREVIOUS_S


def _owned(owns: Owns | None) -> dict[str, Any]:
    return {
        "origins": owners.origins(owns),
        "subscriptions": owners.subscriptions(owns),
        "source_systems": owners.source_systems(owns),
    }


class SigningSecrets:
    """The gateway to ``signing_secret``, with the senders' cache."""

    def __init__(self, engine: Engine, clock: Clock = SYSTEM) -> None:
        self._engine = engine
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], tuple[float, Secrets]] = {}

    def get(self, kind: str, name: str) -> Secrets:
        """A destination's secrets, made now if it has none (read from the table)."""
        _checked(kind, name)
        values = {"kind": kind, "name": name, "secret": new_secret()}
        row = self._made_or_read("signing_secret_get", values)
        if row is None:  # the row exists once the insert it lost to has committed
            raise RuntimeError(f"no signing secret for {kind} {name} after two reads")
        return Secrets(kind, name, row.secret, row.previous, row.previous_until, row.rotated_at)

    def _made_or_read(self, statement: str, values: dict[str, Any]) -> Any:
        """The row of a statement that makes a destination's first secret or reads it; run
        twice at most: a first use racing another is answered by the one it lost to, which
        its statement's snapshot may not have seen yet (its insert waited for that one to
        commit, then did nothing), and a statement of its own sees it."""
        row = None
        for _ in range(2):
            with self._engine.begin() as conn:
                row = conn.execute(sql(statement), values).first()
            if row is not None:
                break
        return row

    def for_send(self, kind: str, name: str) -> list[str]:
        """The secrets a request to the destination is signed with now (cached)."""
        at = self._clock.monotonic()
        with self._lock:
            found = self._cache.get((kind, name))
        if found is None or at - found[0] > CACHE_S:
            found = (at, self.get(kind, name))
            with self._lock:
                self._cache[(kind, name)] = found
        return found[1].signing(datetime.fromtimestamp(self._clock.time(), UTC))

    def show_for(self, kind: str, name: str, owns: Owns | None) -> Secrets:
        """:meth:`get` for an API caller: only a destination that exists and that ``owns``
        holds (None: any); another's, or none, is not found."""
        _checked(kind, name)
        values = {"kind": kind, "name": name, "secret": new_secret(), **_owned(owns)}
        row = self._made_or_read("signing_secret_get_owned", values)
        if row is None:
            raise NotFound(f"{kind} destination", name)
        return Secrets(kind, name, row.secret, row.previous, row.previous_until, row.rotated_at)

    def rotate_for(self, kind: str, name: str, data: Any, owns: Owns | None) -> Secrets:
        """:meth:`rotate` for an API caller (``data``: a RotateIn), as :meth:`show_for`."""
        _checked(kind, name)
        asked = parse_input(RotateIn, {} if data is None else data)
        with self._engine.begin() as conn:
            row = conn.execute(
                sql("signing_secret_rotate_owned"),
                {
                    "kind": kind,
                    "name": name,
                    "secret": new_secret(),
                    "keep_s": asked.keep_previous_s,
                    **_owned(owns),
                },
            ).first()
        if row is None:
            raise NotFound(f"{kind} destination", name)
        with self._lock:
            self._cache.pop((kind, name), None)
        return Secrets(kind, name, row.secret, row.previous, row.previous_until, row.rotated_at)

    def rotate(self, kind: str, name: str, keep_previous_s: int = KEEP_PREVIOUS_S) -> Secrets:
        """A new secret for the destination; the one before is still signed with for
        ``keep_previous_s`` seconds (0: from now on only the new one)."""
        _checked(kind, name)
        if not 0 <= keep_previous_s <= 30 * 86_400:
            raise InvalidMessage("keep_previous_s", "must be 0 to 2592000 (30 days)")
        with self._engine.begin() as conn:
            row = conn.execute(
                sql("signing_secret_rotate"),
                {"kind": kind, "name": name, "secret": new_secret(), "keep_s": keep_previous_s},
            ).one()
        with self._lock:
            self._cache.pop((kind, name), None)
        return Secrets(kind, name, row.secret, row.previous, row.previous_until, row.rotated_at)
