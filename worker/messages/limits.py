"""Funnel limits: how many messages of one funnel value a funnel component runs at once, and
how many may start a second.

A funnel (messages sharing ``funnel_value`` and ``funnel_component_id``) runs one message at a
time, the seed's rule, unless its component has a limit here (table ``funnel_limit``): then up
to ``max_in_flight`` messages of one funnel value run side by side, and with ``rate_per_s``
at most that many start a second (a token bucket of ``burst`` per funnel value,
worker.messages.rates). ``component_id`` ``""``
is the limit of the funnels without a component. The claim reads the table in its own
statement (``orderly_funnel_limit``), so a limit set, changed or removed holds from the next
claim on; messages already running go on. Guaranteed-order messages run one at a time
whatever the limit.

A limit is a setting of the whole system, like the configuration table: the faces let only
keys that act on every object (``admin``) change or read them.

**Naming a component in one word** (a URL's path segment, a command's argument), where ``""``
cannot be written: a word of dashes only stands for one dash fewer. ``-`` is ``""`` (funnels
without a component), ``--`` the component ``-``; every other word is the component itself
(:func:`from_word`, :func:`to_word`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints, field_validator
from sqlalchemy import Engine

from orderly.worker.core.clock import SYSTEM, Clock, utcnow
from orderly.worker.core.errors import InvalidMessage, NotFound
from orderly.worker.core.inputs import parse_input
from orderly.worker.db.queries import sql

# The bounds of the table's check constraint (models/funnel_limit.py).
MIN_IN_FLIGHT = 1
MAX_IN_FLIGHT = 10_000
MAX_COMPONENT = 255
# The component of funnels without one (messages whose funnel_component_id is unset).
NO_COMPONENT = ""

ComponentId = Annotated[str, StringConstraints(strict=True, max_length=MAX_COMPONENT)]
MaxInFlight = Annotated[StrictInt, Field(ge=MIN_IN_FLIGHT, le=MAX_IN_FLIGHT)]
# The bounds of the start rate's check constraints.
MAX_RATE_PER_S = 100_000
MAX_BURST = 10_000
RatePerS = Annotated[float, Field(gt=0, le=MAX_RATE_PER_S, allow_inf_nan=False)]
Burst = Annotated[StrictInt, Field(ge=1, le=MAX_BURST)]


class FunnelLimitIn(BaseModel):
    """A component's limit: how many messages of one funnel value may run at once, and
    (optionally) how many may start a second, in bursts of up to ``burst`` (default: the rate
    rounded up)."""

    model_config = ConfigDict(extra="forbid")

    max_in_flight: MaxInFlight
    rate_per_s: RatePerS | None = None
    burst: Burst | None = None

    @property
    def bucket(self) -> int | None:
        if self.rate_per_s is None:
            return None
        if self.burst is not None:
            return self.burst
        return min(MAX_BURST, max(1, math.ceil(self.rate_per_s)))


class _Component(BaseModel):
    # "" (funnels without a component) to 255 characters, as funnel_component_id is stored.
    component_id: ComponentId

    @field_validator("component_id")
    @classmethod
    def _text(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("NUL characters (\\u0000) are not accepted")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("holds a lone surrogate: not text") from None
        return value


@dataclass(frozen=True)
class FunnelLimitView:
    """A ``funnel_limit`` row, read by column name."""

    component_id: str
    max_in_flight: int
    rate_per_s: float | None
    burst: int | None
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> FunnelLimitView:
        return cls(**{f.name: row[f.name] for f in fields(cls)})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class LimitSet:
    """What :func:`set_limit` stored, and whether the component had no limit before."""

    limit: FunnelLimitView
    created: bool


def from_word(word: str) -> str:
    """The component a one-word name stands for (``-``: funnels without a component)."""
    return word[1:] if word and word.strip("-") == "" else word


def to_word(component_id: str) -> str:
    """The one-word name of a component (:func:`from_word`'s inverse)."""
    return f"-{component_id}" if component_id.strip("-") == "" else component_id


def component(component_id: Any) -> str:
    """A component id as the table keys it; InvalidMessage names ``component_id`` otherwise."""
    return parse_input(_Component, {"component_id": component_id}).component_id


def list_limits(engine: Engine) -> list[FunnelLimitView]:
    """Every limit, by component (``""`` first)."""
    with engine.connect() as conn:
        rows = conn.execute(sql("funnel_limit_list")).mappings().all()
    return [FunnelLimitView.from_row(r) for r in rows]


def get_limit(engine: Engine, component_id: str) -> FunnelLimitView:
    """One component's limit; NotFound when it has none (its funnels run one at a time)."""
    key = component(component_id)
    with engine.connect() as conn:
        row = conn.execute(sql("funnel_limit_show"), {"component_id": key}).mappings().first()
    if row is None:
        raise NotFound("funnel limit", key)
    return FunnelLimitView.from_row(row)


def set_limit(engine: Engine, component_id: Any, data: Any, clock: Clock = SYSTEM) -> LimitSet:
    """Make or replace a component's limit (``data``: ``FunnelLimitIn``). Both are checked
    first, every bad field named in one error; nothing is written when one is refused."""
    problems: list[tuple[str, str]] = []
    key = given = None
    try:
        key = component(component_id)
    except InvalidMessage as exc:
        problems += exc.problems
    try:
        given = parse_input(FunnelLimitIn, data)
    except InvalidMessage as exc:
        problems += exc.problems
    if given is not None and given.burst is not None and given.rate_per_s is None:
        problems.append(("burst", "only meaningful with rate_per_s"))
    if key is None or given is None or problems:
        raise InvalidMessage(*problems[0], *problems[1:])
    params = {
        "component_id": key,
        "max_in_flight": given.max_in_flight,
        "rate_per_s": given.rate_per_s,
        "burst": given.bucket,
        "now": utcnow(clock),
    }
    with engine.begin() as conn:
        row = conn.execute(sql("funnel_limit_set"), params).mappings().one()
    return LimitSet(FunnelLimitView.from_row(row), bool(row["created"]))


def remove_limit(engine: Engine, component_id: str) -> None:
    """Remove a component's limit: its funnels run one message at a time again (from the
    next claim; those running go on). NotFound when it had none."""
    key = component(component_id)
    with engine.begin() as conn:
        found = conn.execute(sql("funnel_limit_delete"), {"component_id": key}).first()
    if found is None:
        raise NotFound("funnel limit", key)
