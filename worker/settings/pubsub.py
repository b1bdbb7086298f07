"""Publish/subscribe: the secret that signs message tokens, and their lifetime."""

from __future__ import annotations

from pydantic import Field

from orderly.worker.settings._base import Section


class PubSubSettings(Section):
    token_secret: str = Field(
        "",
        validation_alias="ORDERLY_TOKEN_SECRET",
        description="HMAC secret of message tokens; consumers refuse messages without a valid one.",
    )
    token_ttl_ms: int = Field(
        86_400_000,
        ge=1,
        validation_alias="ORDERLY_TOKEN_TTL_MS",
        description="A token is valid this long after its message is due.",
    )
