"""The HTTP API's rate limits: token buckets in Redis (worker/core/ratelimit.py) per client
address, per API key, for refused credentials and for the console's sign-ins. A rate of 0
turns that limit off."""

from __future__ import annotations

from pydantic import Field

from orderly.worker.core.ratelimit import Limit
from orderly.worker.settings._base import Section


class RateLimitSettings(Section):
    rate_address_per_s: float = Field(
        2_000,
        ge=0,
        allow_inf_nan=False,
        validation_alias="ORDERLY_RATE_ADDRESS_PER_S",
        description="Requests a second one client address may make, every route together "
        "(0: no limit). Over it: 429 with Retry-After. Behind a proxy the address is the "
        "proxy's unless uvicorn trusts its X-Forwarded-For (--forwarded-allow-ips).",
    )
    rate_address_burst: int = Field(
        4_000,
        ge=1,
        validation_alias="ORDERLY_RATE_ADDRESS_BURST",
        description="Requests a client address may make at once above its rate (the bucket's "
        "size).",
    )
    rate_key_per_s: float = Field(
        1_000,
        ge=0,
        allow_inf_nan=False,
        validation_alias="ORDERLY_RATE_KEY_PER_S",
        description="Requests a second made with one API key, from every address and API "
        "process together (0: no limit).",
    )
    rate_key_burst: int = Field(
        2_000,
        ge=1,
        validation_alias="ORDERLY_RATE_KEY_BURST",
        description="Requests one API key may make at once above its rate.",
    )
    rate_refused_per_s: float = Field(
        20,
        ge=0,
        allow_inf_nan=False,
        validation_alias="ORDERLY_RATE_REFUSED_PER_S",
        description="Refused credentials a second one client address may send (0: no "
        "limit): an API key in the right form that is unknown, revoked or expired, an ACK "
        "with an id or token that matches nothing. Past it the address's refusals, and its "
        "requests that would need such a check, are answered 429.",
    )
    rate_refused_burst: int = Field(
        200,
        ge=1,
        validation_alias="ORDERLY_RATE_REFUSED_BURST",
        description="Refused credentials a client address may send at once above its rate.",
    )
    rate_login_per_min: float = Field(
        5,
        ge=0,
        allow_inf_nan=False,
        validation_alias="ORDERLY_RATE_LOGIN_PER_MIN",
        description="Console sign-ins a minute, counted per client address and, apart, per "
        "key tried (its prefix) (0: no limit); a sign-in over either is refused with 429.",
    )
    rate_login_burst: int = Field(
        10,
        ge=1,
        validation_alias="ORDERLY_RATE_LOGIN_BURST",
        description="Console sign-ins at once above their rate, per client address and per key.",
    )

    @property
    def address_limit(self) -> Limit:
        return Limit(self.rate_address_per_s, self.rate_address_burst)

    @property
    def key_limit(self) -> Limit:
        return Limit(self.rate_key_per_s, self.rate_key_burst)

    @property
    def refused_limit(self) -> Limit:
        return Limit(self.rate_refused_per_s, self.rate_refused_burst)

    @property
    def login_limit(self) -> Limit:
        return Limit(self.rate_login_per_min / 60, self.rate_login_burst)
