"""The dashboards: Flower's login and address, and how long a sign-in to the console lasts."""

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
    console_session_idle_s: int = Field(
        1800,
        ge=60,
        le=2_592_000,
        validation_alias="ORDERLY_CONSOLE_SESSION_IDLE_S",
        description="A console session unused for this many seconds is over: the next visit "
        "gets the sign-in page.",
    )
    console_session_max_s: int = Field(
        43200,
        ge=60,
        le=2_592_000,
        validation_alias="ORDERLY_CONSOLE_SESSION_MAX_S",
        description="A console session is over this many seconds after its sign-in, however busy.",
    )
