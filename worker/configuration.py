"""The configuration table: known parameters, typed reads with defaults, validated writes.

A value is ``current_value`` or else ``default_value``; a mandatory item needs one of them; a
``validation`` regex must match the whole value; the value must convert to ``data_type``.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Engine

from orderly.models import ConfigDataType
from orderly.worker.core.clock import SYSTEM, Clock
from orderly.worker.core.errors import ConfigurationError
from orderly.worker.db.queries import sql


@dataclass(frozen=True)
class ConfigItem:
    code: str
    category: str
    default: str | None
    data_type: ConfigDataType
    description: str
    mandatory: bool = True
    validation: str | None = None


_POSITIVE_INT = r"[1-9][0-9]*"
_NON_NEGATIVE_INT = r"[0-9]+"

# Every parameter the mechanisms read; defaults as in the public implementation.
KNOWN_ITEMS: dict[str, ConfigItem] = {
    item.code: item
    for item in (
        ConfigItem(
            "asynch.countPartlyFailsBeforeFailed",
            "asynch",
            "3",
            ConfigDataType.INT,
            "Retries of a failed message before the next error makes it FAILED (a handler's"
            " Retry(attempts=...) overrides it).",
            validation=_NON_NEGATIVE_INT,
        ),
        ConfigItem(
            "asynch.partlyFailedIntervalSec",
            "asynch",
            "60",
            ConfigDataType.INT,
            "The retry policy's base delay in seconds: retry n of a failed message waits"
            " partlyFailedIntervalSec * partlyFailedMultiplier ^ n (a handler's"
            " Retry(delay_s=...) overrides it).",
            validation=_NON_NEGATIVE_INT,
        ),
        ConfigItem(
            "asynch.partlyFailedMultiplier",
            "asynch",
            "2.0",
            ConfigDataType.FLOAT,
            "Retry n of a failed message waits partlyFailedIntervalSec * multiplier ^ n (1 to"
            " 100; 1: always partlyFailedIntervalSec).",
            validation=r"[1-9][0-9]?(\.[0-9]+)?|100(\.0+)?",
        ),
        ConfigItem(
            "asynch.partlyFailedMaxIntervalSec",
            "asynch",
            "3600",
            ConfigDataType.INT,
            "The longest wait before a retry of a failed message, in seconds (the formula's cap).",
            validation=_NON_NEGATIVE_INT,
        ),
        ConfigItem(
            "asynch.partlyFailedRepeatTimeSec",
            "asynch",
            "60",
            ConfigDataType.INT,
            "Seconds between two runs of the pool's checks: guaranteed order held back by a"
            " FAILED message, response deadlines (read when beat starts).",
            validation=_POSITIVE_INT,
        ),
        ConfigItem(
            "asynch.postponedIntervalSec",
            "asynch",
            "5",
            ConfigDataType.INT,
            "Seconds a POSTPONED message rests before it is looked at again (its funnel's"
            " release normally comes first).",
            validation=_NON_NEGATIVE_INT,
        ),
        ConfigItem(
            "asynch.postponedIntervalWhenFailedSec",
            "asynch",
            "300",
            ConfigDataType.INT,
            "Seconds after which a POSTPONED message in guaranteed order, held back by a FAILED"
            " message of its funnel, becomes FAILED.",
            validation=_POSITIVE_INT,
        ),
        ConfigItem(
            "asynch.funnelIdleIntervalSec",
            "asynch",
            "600",
            ConfigDataType.INT,
            "Seconds a started message holds its funnel (without guaranteed order); after that"
            " the next message of the funnel may start.",
            validation=_POSITIVE_INT,
        ),
        ConfigItem(
            "asynch.responseTimeoutSec",
            "asynch",
            "3600",
            ConfigDataType.INT,
            "Seconds a message waits for an external response (WAITING_FOR_RES) when its"
            " handler names no timeout; then it becomes FAILED.",
            validation=_POSITIVE_INT,
        ),
        ConfigItem(
            "asynch.confirmation.failedLimit",
            "asynch",
            "3",
            ConfigDataType.INT,
            "Failed confirmations to a source system after which the confirmation is"
            " FAILED_END (no further tries); 1 to 101.",
            validation=r"[1-9][0-9]?|10[01]",
        ),
        ConfigItem(
            "asynch.confirmation.intervalSec",
            "asynch",
            "60",
            ConfigDataType.INT,
            "The retry policy's deliveryDelay for failed confirmations, in seconds: retry n"
            " waits intervalSec * multiplier ^ n (0 to 9,999,999).",
            validation=r"[0-9]{1,7}",
        ),
        ConfigItem(
            "asynch.confirmation.multiplier",
            "asynch",
            "1.0",
            ConfigDataType.FLOAT,
            "Retry n of a failed confirmation waits intervalSec * multiplier ^ n (1 to 100;"
            " 1: always intervalSec).",
            validation=r"[1-9][0-9]?(\.[0-9]+)?|100(\.0+)?",
        ),
        ConfigItem(
            "asynch.repairRepeatTimeSec",
            "asynch",
            "300",
            ConfigDataType.INT,
            "Seconds after which NEW/IN_QUEUE/PROCESSING messages and PROCESSING external calls"
            " count as stuck; also the repair job's period (read when beat starts).",
            validation=_POSITIVE_INT,
        ),
        ConfigItem(
            "asynch.pool.batchSize",
            "asynch",
            "500",
            ConfigDataType.INT,
            "Messages the pool or repair moves in one statement.",
            validation=_POSITIVE_INT,
        ),
        ConfigItem(
            "cluster.nodeHeartbeatTimeoutSec",
            "cluster",
            "30",
            ConfigDataType.INT,
            "Seconds without a heartbeat after which a node is shown as not alive.",
            validation=_POSITIVE_INT,
        ),
    )
}


def _converts(value: str, data_type: ConfigDataType) -> bool:
    try:
        if data_type is ConfigDataType.INT:
            int(value)
        elif data_type is ConfigDataType.FLOAT:
            float(value)
        elif data_type is ConfigDataType.BOOLEAN:
            return value.lower() in ("true", "false")
    except ValueError:
        return False
    return True


def value_problems(
    code: str,
    value: str | None,
    data_type: ConfigDataType,
    validation: str | None,
    *,
    mandatory: bool,
    label: str = "value",
) -> list[str]:
    """Why ``value`` is not acceptable for an item (empty list when it is)."""
    if value is None:
        return [f"{code}: mandatory but has neither current nor default value"] if mandatory else []
    problems = []
    if validation is not None:
        try:
            if re.fullmatch(validation, value) is None:
                problems.append(f"{code}: {label} {value!r} does not match {validation!r}")
        except re.error as exc:
            problems.append(f"{code}: validation {validation!r} is not a valid regex ({exc})")
    if not _converts(value, data_type):
        problems.append(f"{code}: {label} {value!r} is not a valid {data_type.value}")
    return problems


@dataclass(frozen=True)
class ConfigRow:
    """One row of the configuration table."""

    code: str
    category_code: str
    current_value: str | None
    default_value: str | None
    data_type: ConfigDataType
    mandatory: bool
    validation: str | None
    description: str | None

    @classmethod
    def of(cls, row: Any) -> ConfigRow:
        return cls(**{**row._mapping, "data_type": ConfigDataType(row.data_type)})


def check_row(row: ConfigRow) -> list[str]:
    problems = []
    effective = row.current_value if row.current_value is not None else row.default_value
    if row.current_value is not None:
        problems += value_problems(
            row.code,
            row.current_value,
            row.data_type,
            row.validation,
            mandatory=row.mandatory,
            label="current value",
        )
    if row.default_value is not None:
        problems += value_problems(
            row.code,
            row.default_value,
            row.data_type,
            row.validation,
            mandatory=row.mandatory,
            label="default value",
        )
    if effective is None and row.mandatory:
        problems.append(f"{row.code}: mandatory but has neither current nor default value")
    return problems


def ensure_defaults(engine: Engine) -> None:
    """Insert the known items that are missing; existing rows are left as the operator set them."""
    rows = [
        {
            "code": item.code,
            "category": item.category,
            "default": item.default,
            "data_type": item.data_type.value,
            "mandatory": item.mandatory,
            "validation": item.validation,
            "description": item.description,
        }
        for item in KNOWN_ITEMS.values()
    ]
    with engine.begin() as conn:
        conn.execute(sql("config_ensure_defaults"), rows)


def list_items(engine: Engine) -> list[ConfigRow]:
    with engine.connect() as conn:
        return [ConfigRow.of(r) for r in conn.execute(sql("config_list"))]


def check_consistency(engine: Engine) -> None:
    """Raise ConfigurationError naming every inconsistent row (used at start-up)."""
    problems = [p for row in list_items(engine) for p in check_row(row)]
    if problems:
        raise ConfigurationError(problems)


def startup_check(engine: Engine) -> None:
    ensure_defaults(engine)
    check_consistency(engine)


def get_item(engine: Engine, code: str) -> ConfigRow:
    with engine.connect() as conn:
        row = conn.execute(sql("config_get"), {"code": code}).first()
    if row is None:
        raise ConfigurationError([f"{code}: no such configuration item"])
    return ConfigRow.of(row)


def set_value(engine: Engine, code: str, value: str | None) -> ConfigRow:
    """Set (or with None, clear) the current value, refusing one that does not validate."""
    with engine.begin() as conn:
        found = conn.execute(sql("config_lock"), {"code": code}).first()
        if found is None:
            raise ConfigurationError([f"{code}: no such configuration item"])
        row = ConfigRow.of(found)
        if value is not None:
            problems = value_problems(
                code, value, row.data_type, row.validation, mandatory=row.mandatory
            )
            if problems:
                raise ConfigurationError(problems)
        elif row.mandatory and row.default_value is None:
            raise ConfigurationError([f"{code}: mandatory and has no default; cannot clear it"])
        conn.execute(sql("config_set"), {"code": code, "value": value})
    return replace(row, current_value=value)


class ConfigReader:
    """Typed reads with a short cache, so hot paths do not query the table per message."""

    def __init__(self, engine: Engine, ttl_seconds: float = 5.0, clock: Clock = SYSTEM) -> None:
        self._engine = engine
        self._clock = clock
        self._ttl = ttl_seconds
        self._values: dict[str, str | None] = {}
        self._loaded_at = float("-inf")
        self._lock = threading.Lock()

    def _refresh(self) -> None:
        with self._engine.connect() as conn:
            self._values = {str(code): value for code, value in conn.execute(sql("config_values"))}
        self._loaded_at = self._clock.monotonic()

    def raw(self, code: str) -> str | None:
        with self._lock:
            if self._clock.monotonic() - self._loaded_at > self._ttl:
                self._refresh()
            if code in self._values:
                return self._values[code]
        item = KNOWN_ITEMS.get(code)
        if item is None:
            raise ConfigurationError([f"{code}: no such configuration item"])
        return item.default

    def get_int(self, code: str) -> int:
        value = self.raw(code)
        if value is None:
            raise ConfigurationError([f"{code}: has no value"])
        return int(value)

    def get_float(self, code: str) -> float:
        value = self.raw(code)
        if value is None:
            raise ConfigurationError([f"{code}: has no value"])
        return float(value)

    def invalidate(self) -> None:
        with self._lock:
            self._loaded_at = float("-inf")
