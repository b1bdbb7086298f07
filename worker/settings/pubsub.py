"""Publish/subscribe: the secret that signs message tokens, their lifetime, and what checking
a payload against its event type's schema may cost."""

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
    schema_max_unique_items: int = Field(
        2_000,
        ge=0,
        validation_alias="ORDERLY_SCHEMA_MAX_UNIQUE_ITEMS",
        description=(
            "Longest payload array an event type's schema checks with uniqueItems; a longer"
            " one is refused at publish, naming this limit."
        ),
    )
    schema_validation_budget_ms: int = Field(
        2_000,
        ge=1,
        validation_alias="ORDERLY_SCHEMA_VALIDATION_BUDGET_MS",
        description=(
            "CPU time one publish may spend validating its payload against its event type's"
            " schema; past it the publish is refused, naming this limit."
        ),
    )
    endpoint_circuit_failures: int = Field(
        5,
        ge=1,
        le=10_000,
        validation_alias="ORDERLY_ENDPOINT_CIRCUIT_FAILURES",
        description=(
            "Failed sends in a row that open a PUSH endpoint's circuit: it then gets one probe"
            " at its backoff interval until one succeeds."
        ),
    )
    endpoint_probe_max_ms: int = Field(
        600_000,
        ge=1,
        le=86_400_000,
        validation_alias="ORDERLY_ENDPOINT_PROBE_MAX_MS",
        description="Longest wait between two probes of an endpoint whose circuit is open.",
    )
    endpoint_disable_after_s: float = Field(
        432_000.0,
        gt=0,
        le=31_622_400,
        validation_alias="ORDERLY_ENDPOINT_DISABLE_AFTER_S",
        description=(
            "An endpoint failing this long (every send since its first failure) is disabled and"
            " an endpoint.disabled event goes to the orderly-system room; an operator enables"
            " it again."
        ),
    )
    pull_max_wait_ms: int = Field(
        20_000,
        ge=0,
        le=20_000,
        validation_alias="ORDERLY_PULL_MAX_WAIT_MS",
        description=(
            "The longest a PULL consumer's GET .../messages?wait_ms= waits for an event (a"
            " longer wait_ms waits this long; 0: pulls never wait)."
        ),
    )
