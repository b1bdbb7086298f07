"""What an API key may act on: its tenant's source systems, origins and subscriptions.

A key holds an :class:`Owns`, or ``None``: every object (an admin key, a metrics key, and every
key made without ``owns``). Each store query that reads or writes an object takes the owned
names as one parameter (``NULL``: any) and checks them in the same statement, so that another
tenant's object is simply not found: the same 404 as an object that does not exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from orderly.worker.core.errors import NotFound

KINDS = ("source_systems", "origins", "subscriptions")


@dataclass(frozen=True)
class Owns:
    """A key's objects: messages by their source system, conversations by their origin,
    pull subscriptions (and their deliveries, dead letters and logs) by id."""

    source_systems: frozenset[str] = frozenset()
    origins: frozenset[str] = frozenset()
    subscriptions: frozenset[int] = frozenset()

    def as_json(self) -> dict[str, list[Any]]:
        return {
            "source_systems": sorted(self.source_systems),
            "origins": sorted(self.origins),
            "subscriptions": sorted(self.subscriptions),
        }

    @classmethod
    def from_json(cls, data: dict[str, Iterable[Any]] | None) -> Owns | None:
        if data is None:
            return None
        return cls(
            frozenset(str(s) for s in data.get("source_systems") or ()),
            frozenset(str(o) for o in data.get("origins") or ()),
            frozenset(int(i) for i in data.get("subscriptions") or ()),
        )


# The parameters the store's queries take: None (NULL in SQL) for a key that owns everything.


def source_systems(owns: Owns | None) -> list[str] | None:
    return None if owns is None else sorted(owns.source_systems)


def origins(owns: Owns | None) -> list[str] | None:
    return None if owns is None else sorted(owns.origins)


def subscriptions(owns: Owns | None) -> list[int] | None:
    return None if owns is None else sorted(owns.subscriptions)


def require_source_system(owns: Owns | None, name: str) -> None:
    """A new message may name only a source system of the key's (else 404, as if unknown)."""
    if owns is not None and name not in owns.source_systems:
        raise NotFound("source system", name)


def require_origin(owns: Owns | None, origin: str) -> None:
    """A new conversation request may name only an origin of the key's (else 404)."""
    if owns is not None and origin not in owns.origins:
        raise NotFound("channel", origin)
