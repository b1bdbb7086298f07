"""The ``configuration`` table: typed, validated parameters the mechanisms read."""

from __future__ import annotations

from sqlalchemy import Boolean, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base, str_enum
from orderly.models.enums import ConfigDataType


class Configuration(Base):
    __tablename__ = "configuration"

    code: Mapped[str] = mapped_column(String(255), primary_key=True)
    category_code: Mapped[str] = mapped_column(String(100))
    current_value: Mapped[str | None] = mapped_column(String(1000))
    default_value: Mapped[str | None] = mapped_column(String(1000))
    data_type: Mapped[ConfigDataType] = mapped_column(str_enum(ConfigDataType, "config_data_type"))
    mandatory: Mapped[bool] = mapped_column(Boolean, default=True, server_default="true")
    validation: Mapped[str | None] = mapped_column(String(1000))
    description: Mapped[str | None] = mapped_column(Text)
