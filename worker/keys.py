"""API keys: who may call orderly's HTTP API, and for what.

A key is a bearer token ``orderly_<prefix>_<secret>``. PostgreSQL keeps its name, its prefix
(to find it), the SHA-256 of the whole token (to check it: the token is 256 random bits, so a
fast hash is enough), its scopes, an optional expiry, and when it was revoked and last used.
The token itself is shown once, by :func:`create_key`.

Scopes (:data:`SCOPES`): ``produce`` (messages, conversation requests and responses, external
responses), ``publish:<room>`` or ``publish:*`` (events), ``consume`` (pull and acknowledge
pulled events), ``operate`` (list, show, cancel, re-drive; conversations, dead letters),
``admin`` (channels, rooms, event types, publishers, subscriptions, source systems, keys),
``metrics`` (``GET /metrics``) and ``impersonate`` (publish in another user's name).

Scopes say what kind of thing a key may do; ``owns`` (worker.core.owners) says to whose
objects: a key made with ``owns`` acts only on the source systems, origins and subscriptions
it names, and every other object answers as if it did not exist. A key made without it acts
on every object; ``admin`` and ``metrics`` keys always do (they cannot be given ``owns``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from sqlalchemy import Connection, Engine

from orderly.worker.core.clock import SYSTEM, Clock, utcnow
from orderly.worker.core.errors import Forbidden, InvalidMessage, NotFound, Unauthenticated
from orderly.worker.core.inputs import parse_input, parse_timestamp
from orderly.worker.core.owners import Owns
from orderly.worker.core.scopes import (
    ADMIN,
    CONSUME,
    IMPERSONATE,
    METRICS,
    OPERATE,
    PRODUCE,
    PUBLISH_ANY,
    SCOPES,
    publish_scope,
)
from orderly.worker.db.queries import sql
from orderly.worker.pubsub.routing import NAME_PATTERN, Name

__all__ = [
    "ADMIN",
    "CONSUME",
    "IMPERSONATE",
    "METRICS",
    "OPERATE",
    "PRODUCE",
    "PUBLISH_ANY",
    "SCOPES",
    "Owns",
    "Principal",
    "authenticate",
    "create_key",
    "list_keys",
    "publish_scope",
    "revoke_key",
]

_SCOPE = re.compile(
    rf"^({'|'.join(s for s in SCOPES if s != PUBLISH_ANY)}|publish:(\*|{NAME_PATTERN[1:-1]}))$"
)
TOKEN_PREFIX = "orderly_"
# How stale ``last_used_at`` may get: a key in use is written at most once per this.
LAST_USED_EVERY = timedelta(seconds=60)


def _scope(value: str) -> str:
    if not _SCOPE.fullmatch(value):
        raise ValueError(f"unknown scope {value!r}: one of {', '.join(SCOPES)} or publish:<room>")
    return value


Scope = Annotated[str, StringConstraints(strict=True, max_length=120), AfterValidator(_scope)]
# Keys that see across tenants by nature: they cannot be bound to objects.
UNBOUND_SCOPES = frozenset({ADMIN, METRICS})
# Names a key may own, of each kind: far above one tenant's, and a bound on the key's row.
MAX_OWNED = 1000


class OwnsIn(BaseModel):
    """The objects a key may act on (each list may be empty: none of that kind)."""

    model_config = ConfigDict(extra="forbid")

    source_systems: Annotated[list[Name], Field(max_length=MAX_OWNED)] = []
    origins: Annotated[list[Name], Field(max_length=MAX_OWNED)] = []
    subscriptions: Annotated[
        list[Annotated[int, Field(strict=True, ge=1)]], Field(max_length=MAX_OWNED)
    ] = []


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    scopes: Annotated[list[Scope], Field(min_length=1, max_length=len(SCOPES) + 100)]
    expires_at: datetime | None = None
    # None: every object (as every key made before owns existed).
    owns: OwnsIn | None = None


@dataclass(frozen=True)
class Principal:
    """The caller a key stands for."""

    name: str
    scopes: frozenset[str]
    # Kept so that a verified key held in memory (api.http.auth) stops at its expiry exactly.
    expires_at: datetime | None = field(default=None, compare=False)
    # The objects it may act on; None: every object.
    owns: Owns | None = None

    def allows(self, scope: str) -> bool:
        if scope in self.scopes:
            return True
        return scope.startswith("publish:") and PUBLISH_ANY in self.scopes

    def require(self, scope: str) -> None:
        if not self.allows(scope):
            raise Forbidden(scope, self.name)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _view(row: Any) -> dict[str, Any]:
    owns = Owns.from_json(row.owns)
    return {
        "name": row.name,
        "prefix": row.prefix,
        "scopes": list(row.scopes),
        "owns": None if owns is None else owns.as_json(),
        "created_at": row.created_at.isoformat(),
        "expires_at": None if row.expires_at is None else row.expires_at.isoformat(),
        "revoked_at": None if row.revoked_at is None else row.revoked_at.isoformat(),
        "last_used_at": None if row.last_used_at is None else row.last_used_at.isoformat(),
    }


def create_key(engine: Engine, data: Any, clock: Clock = SYSTEM) -> tuple[dict[str, Any], str]:
    """A new key: its description and its token (shown this once, never stored)."""
    if isinstance(data, dict) and isinstance(data.get("expires_at"), str):
        try:
            data = {**data, "expires_at": parse_timestamp(data["expires_at"])}
        except ValueError as exc:
            raise InvalidMessage("expires_at", str(exc)) from None
    key = parse_input(KeyIn, data)
    now = utcnow(clock)
    if key.expires_at is not None:
        if key.expires_at.tzinfo is None:
            raise InvalidMessage("expires_at", "give a time zone (e.g. 2027-01-31T12:00:00Z)")
        if key.expires_at <= now:
            raise InvalidMessage("expires_at", f"{key.expires_at.isoformat()} is not ahead")
    owns = None
    if key.owns is not None:
        unbound = sorted(UNBOUND_SCOPES.intersection(key.scopes))
        if unbound:
            raise InvalidMessage(
                "owns", f"a key with {', '.join(unbound)} acts on every object: leave owns out"
            )
        owns = Owns(
            frozenset(key.owns.source_systems),
            frozenset(key.owns.origins),
            frozenset(key.owns.subscriptions),
        ).as_json()
    prefix = secrets.token_hex(6)
    token = f"{TOKEN_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    with engine.begin() as conn:
        row = conn.execute(
            sql("api_key_insert"),
            {
                "name": key.name,
                "prefix": prefix,
                "secret_hash": _hash(token),
                "scopes": sorted(set(key.scopes)),
                "created_at": now,
                "expires_at": key.expires_at,
                "owns": None if owns is None else json.dumps(owns),
            },
        ).first()
    if row is None:
        raise InvalidMessage("name", f"a live key is named {key.name!r}: revoke it first")
    return _view(row), token


def list_keys(engine: Engine, *, revoked: bool = False) -> list[dict[str, Any]]:
    """Keys by name (the revoked ones too with ``revoked``); never their tokens."""
    with engine.connect() as conn:
        return [_view(r) for r in conn.execute(sql("api_key_list"), {"revoked": revoked})]


def revoke_key(engine: Engine, name: str, clock: Clock = SYSTEM) -> dict[str, Any]:
    """Revoke the live key of that name: refused from its next lookup on (an API process
    holds a key it verified for a few seconds: api.http.auth)."""
    with engine.begin() as conn:
        row = conn.execute(sql("api_key_revoke"), {"name": name, "now": utcnow(clock)}).first()
    if row is None:
        raise NotFound("API key", name)
    return _view(row)


UNKNOWN_KEY = "unknown API key"


def key_prefix(token: str | None) -> str:
    """The prefix (what names the key) of a token in an API key's form; Unauthenticated
    when it has none, without a lookup."""
    if not token:
        raise Unauthenticated("missing: send Authorization: Bearer <API key>")
    parts = token.removeprefix(TOKEN_PREFIX).split("_", 1) if token.startswith(TOKEN_PREFIX) else []
    if len(parts) != 2 or len(token) > 200:
        raise Unauthenticated("not an orderly API key")
    return parts[0]


def authenticate(
    engine: Engine, token: str | None, clock: Clock = SYSTEM, *, scope: str | None = None
) -> Principal:
    """The key a bearer token stands for; Unauthenticated says why not, Forbidden when it
    lacks ``scope``. Only a key that passes records its use: a refused request writes
    nothing."""
    prefix = key_prefix(token)
    now = utcnow(clock)
    with engine.connect() as conn:
        row = conn.execute(sql("api_key_by_prefix"), {"prefix": prefix}).first()
        if row is None or not hmac.compare_digest(row.secret_hash, _hash(token or "")):
            raise Unauthenticated(UNKNOWN_KEY)
        return _admitted(conn, row, now, scope)


def live_key(engine: Engine, prefix: str, clock: Clock = SYSTEM) -> Principal:
    """The key of that prefix (its secret checked before, as a console session's was) while
    it may be used: the checks :func:`authenticate` makes after the secret."""
    with engine.connect() as conn:
        row = conn.execute(sql("api_key_by_prefix"), {"prefix": prefix}).first()
        if row is None:
            raise Unauthenticated(UNKNOWN_KEY)
        return _admitted(conn, row, utcnow(clock), None)


def _admitted(conn: Connection, row: Any, now: datetime, scope: str | None) -> Principal:
    """The key of ``row`` if neither revoked nor expired (and holding ``scope``); its use
    recorded, at most once per LAST_USED_EVERY, only when it passes."""
    if row.revoked_at is not None:
        raise Unauthenticated(f"the key {row.name!r} was revoked")
    if row.expires_at is not None and row.expires_at <= now:
        raise Unauthenticated(f"the key {row.name!r} expired at {row.expires_at.isoformat()}")
    found = Principal(row.name, frozenset(row.scopes), row.expires_at, Owns.from_json(row.owns))
    if scope is not None:
        found.require(scope)
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_EVERY:
        conn.execute(sql("api_key_used"), {"key_id": row.key_id, "now": now})
        conn.commit()
    return found
