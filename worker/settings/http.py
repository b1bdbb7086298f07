"""The one outbound HTTP client (worker.core.http): timeouts, proxy, CA bundle, answer size."""

from __future__ import annotations

from pydantic import Field, field_validator

from orderly.worker.core.addresses import AddressPolicy
from orderly.worker.settings._base import Section


class HttpSettings(Section):
    http_connect_timeout_ms: int = Field(
        3_000,
        ge=1,
        le=60_000,
        validation_alias="ORDERLY_HTTP_CONNECT_TIMEOUT_MS",
        description="Connect timeout of every outbound request (the total deadline is each "
        "call's own: a channel's, a subscription's or a source system's timeout_ms).",
    )
    http_proxy: str | None = Field(
        None,
        validation_alias="ORDERLY_HTTP_PROXY",
        description="Proxy for every outbound request (http://host:port); the environment's "
        "proxy variables are not read.",
    )
    http_ca_bundle: str | None = Field(
        None,
        validation_alias="ORDERLY_HTTP_CA_BUNDLE",
        description="CA certificates (a PEM file) that outbound https:// requests trust "
        "instead of the default bundle.",
    )
    http_max_response_bytes: int = Field(
        1_048_576,
        ge=1024,
        validation_alias="ORDERLY_HTTP_MAX_RESPONSE_BYTES",
        description="At most this much of an answer is read.",
    )

    outbound_allow: str = Field(
        "",
        validation_alias="ORDERLY_OUTBOUND_ALLOW",
        description="Internal hosts and networks outbound requests (channels, push "
        "subscriptions, confirmations) may reach, comma-separated: addresses, CIDR networks, "
        "host names as written in URLs. Loopback, private, shared, link-local, multicast and "
        "reserved addresses are refused otherwise.",
    )

    @field_validator("outbound_allow")
    @classmethod
    def _allow(cls, value: str) -> str:
        AddressPolicy.parse(value)  # ValueError names the bad entry
        return value

    @property
    def outbound_policy(self) -> AddressPolicy:
        return AddressPolicy.parse(self.outbound_allow)

    @field_validator("http_proxy")
    @classmethod
    def _proxy_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("ORDERLY_HTTP_PROXY must be an http:// or https:// URL")
        return value or None

    @field_validator("http_ca_bundle")
    @classmethod
    def _ca_file(cls, value: str | None) -> str | None:
        from pathlib import Path

        if value and not Path(value).is_file():
            raise ValueError(f"ORDERLY_HTTP_CA_BUNDLE {value!r} is not a file")
        return value or None
