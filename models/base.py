"""Declarative base with a constraint naming convention, so migrations name things stably."""

from __future__ import annotations

import enum
from typing import Any

from sqlalchemy import Enum, MetaData
from sqlalchemy.orm import DeclarativeBase

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def str_enum(enum_cls: type[enum.Enum], name: str) -> Enum:
    """A VARCHAR column with a CHECK constraint holding the enum's values (easy to migrate)."""
    kwargs: dict[str, Any] = {
        "native_enum": False,
        "create_constraint": True,
        "length": 32,
        "name": name,
        "values_callable": lambda cls: [member.value for member in cls],
        "validate_strings": True,
    }
    return Enum(enum_cls, **kwargs)
