"""The dashboard (Flower): its login and address."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator

from orderly.worker.settings._base import Section


class DashboardSettings(Section):
    flower_user: str = Field(
        "orderly",
        min_length=1,
        pattern=r"^[^:,\s]+$",
        validation_alias="ORDERLY_FLOWER_USER",
        description="User of Flower's HTTP basic auth (no colon, comma or blank).",
    )
    flower_password: SecretStr = Field(
        SecretStr(""),
        validation_alias="ORDERLY_FLOWER_PASSWORD",
        description="Password of Flower's HTTP basic auth (no comma: Flower reads a list of "
        "user:password pairs); Flower refuses to start without one.",
    )

    @field_validator("flower_password")
    @classmethod
    def _no_comma(cls, value: SecretStr) -> SecretStr:
        if "," in value.get_secret_value():
            raise ValueError(
                "ORDERLY_FLOWER_PASSWORD may not hold a comma (Flower would split it in two)"
            )
        return value

    flower_address: str = Field(
        "127.0.0.1",
        validation_alias="ORDERLY_FLOWER_ADDRESS",
        description="Address Flower listens on (0.0.0.0 inside a container).",
    )
    flower_port: int = Field(
        5555,
        ge=1,
        le=65535,
        validation_alias="ORDERLY_FLOWER_PORT",
        description="Port Flower listens on.",
    )
