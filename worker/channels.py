"""Channels: each origin's delivery URL and retry policy, from the channel table or settings.

A row in ``channel`` (``PUT /channels/{origin}``) wins over ``ORDERLY_CHANNELS``; the policy
fields a row leaves out come from the ``ORDERLY_CHANNEL_*`` defaults.

Every origin also has an ACK secret (``channel_ack_secret``, made by PostgreSQL the first
time the origin is read): each response's POST carries ``X-Orderly-Ack-Token``, an HMAC of
its conversation and response ids under that secret, and the client's ACK must bring it back
(:func:`ack_token`), so that an ACK id guessed by someone else releases nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Annotated, Any
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints
from sqlalchemy import Engine

from orderly.worker.core.clock import SYSTEM, Clock
from orderly.worker.core.errors import InvalidMessage, UnknownChannel
from orderly.worker.core.retry import MAX_ATTEMPTS, MAX_MULTIPLIER, RetryPolicy, policy_problems
from orderly.worker.db.queries import sql
from orderly.worker.settings import Settings

log = logging.getLogger(__name__)

CACHE_SECONDS = 5.0
# The header a response's POST carries its ACK token in, and the client's ACK brings it back in.
ACK_TOKEN_HEADER = "X-Orderly-Ack-Token"
# What an ACK token looks like: a SHA-256 in unpadded base64url.
ACK_TOKEN_FORM = re.compile(r"[A-Za-z0-9_-]{43}")


@dataclass(frozen=True)
class Channel:
    origin: str
    url: str
    delivery_delay_ms: int
    multiplier: float
    attempts: int
    timeout_ms: int
    # The key of this origin's ACK tokens; never shown (not in as_dict).
    ack_secret: str = field(default="", repr=False, compare=False)

    @property
    def policy(self) -> RetryPolicy:
        """The channel's retries: deliveryDelay * multiplier ^ attempt, ``attempts`` of them."""
        return RetryPolicy(self.delivery_delay_ms, self.multiplier, self.attempts)

    def as_dict(self) -> dict[str, Any]:
        shown = asdict(self)
        del shown["ack_secret"]
        return shown


def ack_token(secret: str, conversation_id: str, response_id: str) -> str:
    """The token a client's ACK of this response must carry (``X-Orderly-Ack-Token``)."""
    if not secret:
        raise ValueError("a channel without its ACK secret signs nothing")
    mac = hmac.new(secret.encode(), f"{conversation_id}\n{response_id}".encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")


def ack_token_matches(secret: str, conversation_id: str, response_id: str, given: str) -> bool:
    expected = ack_token(secret, conversation_id, response_id).encode()
    return hmac.compare_digest(expected, given.encode("utf-8", "surrogateescape"))


class ChannelIn(BaseModel):
    """``PUT /channels/{origin}``: where that origin's responses go and how they are retried;
    a policy field left out takes its ``ORDERLY_CHANNEL_*`` default (checked by
    :func:`validate`, which names every bad field)."""

    model_config = ConfigDict(extra="forbid")

    url: Annotated[str, StringConstraints(pattern=r"^https?://\S+$", max_length=1000)]
    delivery_delay_ms: Annotated[StrictInt, Field(ge=1)] | None = None
    multiplier: Annotated[float, Field(ge=1, le=MAX_MULTIPLIER, allow_inf_nan=False)] | None = None
    attempts: Annotated[StrictInt, Field(ge=0, le=MAX_ATTEMPTS)] | None = None
    timeout_ms: Annotated[StrictInt, Field(ge=1)] | None = None


def validate(
    origin: str, data: dict[str, Any], settings: Settings, *, partial_ok: bool = True
) -> Channel:
    """A channel definition from input; InvalidMessage names every bad field."""
    problems: list[tuple[str, str]] = []
    known = set(ChannelIn.model_fields)
    for name in sorted(set(data) - known):
        problems.append((name, "unknown field"))
    if not origin.strip() or len(origin) > 100:
        problems.append(("origin", "must be 1 to 100 characters"))
    url = data.get("url")
    if not isinstance(url, str):
        problems.append(("url", "missing" if url is None else "must be a string"))
    else:
        try:
            parsed = urlparse(url)
            parsed.port  # noqa: B018 (raises for a port that is not one)
        except ValueError:  # an unclosed IPv6 bracket, a port beyond 65535
            parsed = urlparse("")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            problems.append(("url", f"{url!r} is not an http:// or https:// URL"))
        else:
            try:
                settings.outbound_policy.check_url("url", url)
            except InvalidMessage as exc:
                problems.extend(exc.problems)

    def value(name: str, default: float) -> Any:
        found = data.get(name, default)
        # JSON has one number type: 1000.0 is the whole number 1000.
        if isinstance(found, float) and found.is_integer() and name != "multiplier":
            return int(found)
        return found

    delay = value("delivery_delay_ms", settings.channel_delivery_delay_ms)
    multiplier = value("multiplier", settings.channel_multiplier)
    attempts = value("attempts", settings.channel_attempts)
    timeout = value("timeout_ms", settings.channel_timeout_ms)
    for name, problem in policy_problems(delay, multiplier, attempts):
        problems.append(({"delay_ms": "delivery_delay_ms"}.get(name, name), problem))
    if isinstance(delay, int) and not isinstance(delay, bool) and delay < 1:
        problems.append(("delivery_delay_ms", f"must be at least 1, got {delay}"))
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        problems.append(("timeout_ms", f"must be a whole number of at least 1, got {timeout!r}"))
        timeout = settings.channel_timeout_ms
    # A send must end before its conversation's lease does (MAX_PENDING_TTL).
    if timeout >= settings.max_pending_ttl:
        problems.append(
            (
                "timeout_ms",
                f"must be below AURA_QUEUE_MANAGER_MAX_PENDING_TTL ({settings.max_pending_ttl})",
            )
        )
    if problems:
        raise InvalidMessage(problems[0][0], problems[0][1], *problems[1:])
    return Channel(origin, str(url), delay, float(multiplier), attempts, timeout)


def put_channel(engine: Engine, channel: Channel) -> None:
    with engine.begin() as conn:
        conn.execute(sql("channel_put"), channel.as_dict())


def _within_policy(channel: Channel) -> Channel:
    """A row stored before the retry policy's bounds were checked is held to them (with a
    warning), so that its sends are settled like any other."""
    attempts = min(channel.attempts, MAX_ATTEMPTS)
    multiplier = min(channel.multiplier, MAX_MULTIPLIER)
    if (attempts, multiplier) == (channel.attempts, channel.multiplier):
        return channel
    log.warning(
        "channel %s: attempts %s and multiplier %s held to the policy's bounds (%s, %s);"
        " PUT the channel again to store them",
        channel.origin,
        channel.attempts,
        channel.multiplier,
        attempts,
        multiplier,
    )
    return replace(channel, attempts=attempts, multiplier=multiplier)


class ChannelDirectory:
    """Channels by origin, read through a short cache (a PUT shows within CACHE_SECONDS)."""

    def __init__(self, engine: Engine, settings: Settings, clock: Clock = SYSTEM) -> None:
        self._engine = engine
        self._settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[str, Channel] = {}
        self._loaded_at = float("-inf")

    def _from_settings(self, origin: str) -> Channel | None:
        url = self._settings.channels.get(origin)
        if url is None:
            return None
        s = self._settings
        return Channel(
            origin,
            url,
            s.channel_delivery_delay_ms,
            s.channel_multiplier,
            s.channel_attempts,
            s.channel_timeout_ms,
        )

    def _capped(self, channel: Channel) -> Channel:
        # A send must end while its drain still holds the conversation (MAX_PENDING_TTL).
        cap = max(1, self._settings.max_pending_ttl // 2)
        if channel.timeout_ms <= cap:
            return channel
        return replace(channel, timeout_ms=cap)

    def _reload(self) -> None:
        with self._engine.connect() as conn:
            rows = conn.execute(sql("channel_list")).all()
        channels = {o: c for o in self._settings.channels if (c := self._from_settings(o))}
        for row in rows:
            channels[row.origin] = _within_policy(Channel(*row))
        secrets = self._ack_secrets(channels)
        self._cache = {
            o: self._capped(replace(c, ack_secret=secrets[o])) for o, c in channels.items()
        }
        self._loaded_at = self._clock.monotonic()

    def _ack_secrets(self, channels: dict[str, Channel]) -> dict[str, str]:
        """Every origin's ACK secret; the first read of an origin makes its secret (one
        INSERT ... ON CONFLICT DO NOTHING: every process gets the same)."""
        with self._engine.connect() as conn:
            found = {r.origin: r.secret for r in conn.execute(sql("ack_secrets"))}
            missing = sorted(set(channels) - set(found))
            if missing:
                conn.execute(sql("ack_secrets_make"), {"origins": missing})
                conn.commit()
                found = {r.origin: r.secret for r in conn.execute(sql("ack_secrets"))}
        return found

    def all(self) -> dict[str, Channel]:
        with self._lock:
            if self._clock.monotonic() - self._loaded_at > CACHE_SECONDS:
                self._reload()
            return dict(self._cache)

    def get(self, origin: str) -> Channel:
        channel = self.all().get(origin)
        if channel is None:
            with self._lock:
                self._reload()  # a channel created a moment ago
                channel = self._cache.get(origin)
        if channel is None:
            raise UnknownChannel(origin)
        return channel

    def invalidate(self) -> None:
        with self._lock:
            self._loaded_at = float("-inf")
