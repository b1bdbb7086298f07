"""Console sessions: what a signed-in browser's cookie stands for, kept in Redis, and the API
key behind it, checked live in PostgreSQL at every use.

The cookie holds a random session id and nothing else: it is no API key, so the API refuses
it. Redis keeps the session under the SHA-256 of its id (models.keys.console_session), as JSON:
the key's prefix and name, the session's own form token, when it began and when it was last
used. A session is over once unused for ``idle_s``, ``max_s`` after it began, at sign-out, or
at its first use after its key was revoked or expired: each use loads the key's row by its
prefix (not through the API's key cache), so a revocation anywhere holds from the next request
on. An unknown session id costs one Redis read and nothing of PostgreSQL.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import asdict, dataclass, replace

import redis
from sqlalchemy import Engine

from orderly.models.keys import console_session
from orderly.worker import keys
from orderly.worker.core.clock import Clock, now_ms
from orderly.worker.core.errors import Unauthenticated

# 256 random bits, like an API key's secret.
SESSION_ID_BYTES = 32
# token_urlsafe(32) is 43 characters: a longer cookie is no session id, and is not hashed.
MAX_ID_CHARS = 64
UNKNOWN = "signed out (or never signed in): sign in again"


@dataclass(frozen=True)
class Session:
    """One signed-in browser: the key it stands for, and the token its forms must carry."""

    key_prefix: str
    key_name: str
    form_token: str
    created_ms: int
    seen_ms: int

    def as_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> Session | None:
        """The stored session; None when there is none (or it is not one of ours)."""
        if raw is None:
            return None
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError):
            return None


class ConsoleSessions:
    """The console's sessions in one Redis, on one clock, with one idle and absolute limit."""

    def __init__(
        self, client: redis.Redis, engine: Engine, clock: Clock, *, idle_s: int, max_s: int
    ) -> None:
        self._client = client
        self._engine = engine
        self._clock = clock
        self._idle_ms = idle_s * 1000
        self._max_ms = max_s * 1000

    @staticmethod
    def _key(session_id: str) -> str:
        return console_session(hashlib.sha256(session_id.encode()).hexdigest())

    def _ttl_ms(self, session: Session, now: int) -> int:
        """How long Redis keeps it unused: its idle end, or its absolute end if sooner. The
        clock's checks in :meth:`resolve` decide; this only lets Redis forget it."""
        return max(1, min(self._idle_ms, session.created_ms + self._max_ms - now))

    def open(self, token: str, key_name: str, replacing: str | None = None) -> str:
        """A new session for the key ``token`` (authenticated by the caller); its id, for the
        cookie. ``replacing``: the browser's previous session id, ended."""
        if replacing:
            self.close(replacing)
        session_id = secrets.token_urlsafe(SESSION_ID_BYTES)
        now = now_ms(self._clock)
        found = Session(keys.key_prefix(token), key_name, secrets.token_urlsafe(32), now, now)
        made = self._client.set(
            self._key(session_id), found.as_json(), nx=True, px=self._ttl_ms(found, now)
        )
        if not made:  # 256 random bits drawn twice: never, but never another's session either
            raise RuntimeError("a console session id was drawn twice")
        return session_id

    def resolve(self, session_id: str) -> tuple[Session, keys.Principal]:
        """The session of that id and its key, both live; Unauthenticated says why not (an
        ended session is deleted)."""
        if not session_id or len(session_id) > MAX_ID_CHARS:
            raise Unauthenticated(UNKNOWN)
        name = self._key(session_id)
        found = Session.from_json(self._client.get(name))
        if found is None:
            raise Unauthenticated(UNKNOWN)
        now = now_ms(self._clock)
        try:
            self._check(found, now)
            key = keys.live_key(self._engine, found.key_prefix, self._clock)
        except Unauthenticated:
            self._client.delete(name)
            raise
        # XX: a session ended meanwhile (a sign-out, another request finding its key revoked)
        # is not brought back by this use. The rest of the value never changes.
        self._client.set(
            name, replace(found, seen_ms=now).as_json(), xx=True, px=self._ttl_ms(found, now)
        )
        return found, key

    def _check(self, session: Session, now: int) -> None:
        if now - session.seen_ms >= self._idle_ms:
            raise Unauthenticated(
                f"signed out after {self._idle_ms // 1000} s without use: sign in again"
            )
        if now - session.created_ms >= self._max_ms:
            raise Unauthenticated(
                f"signed out {self._max_ms // 1000} s after signing in: sign in again"
            )

    def close(self, session_id: str) -> bool:
        """End the session of that id (sign-out): its cookie is refused from now on, even
        replayed. Whether there was one."""
        if not session_id or len(session_id) > MAX_ID_CHARS:
            return False
        return bool(self._client.delete(self._key(session_id)))
