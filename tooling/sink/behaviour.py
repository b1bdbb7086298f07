"""The sink's behaviour: how it answers each delivery (probabilities, rules, seed), validated."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_PROBABILITIES = ("p_recoverable", "p_timeout", "p_non_recoverable", "p_async")
_BEHAVIOUR_FIELDS = frozenset(
    {
        "seed",
        *_PROBABILITIES,
        "p_never_ack",
        "ack_delay_ms",
        "timeout_sleep_ms",
        "orderly_url",
        "rules",
    }
)
_RULE_FIELDS = frozenset({"match", "status", "times", "never_ack", "delay_ms"})
_MATCH_FIELDS = frozenset({"conversation_id", "response_id"})


class BehaviourError(ValueError):
    """A behaviour setting that cannot be applied; ``field`` names it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def _number(value: Any, field: str, *, low: float = 0.0, high: float = math.inf) -> float:
    # bool is an int subclass; True as a probability is a caller bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BehaviourError(field, f"must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        raise BehaviourError(field, f"must be between {low:g} and {high:g}, got {value!r}")
    return number


def _integer(value: Any, field: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BehaviourError(field, f"must be an integer, got {value!r}")
    if value < low:
        raise BehaviourError(field, f"must be at least {low}, got {value!r}")
    return value


def _unknown(data: Mapping[str, Any], allowed: frozenset[str], prefix: str) -> None:
    for name in data:
        if name not in allowed:
            raise BehaviourError(f"{prefix}{name}", f"unknown field (allowed: {sorted(allowed)})")


@dataclass(frozen=True, slots=True)
class Rule:
    """A deterministic override: the arrivals it matches get ``status``, ``times`` times."""

    conversation_id: str | None = None
    response_id: str | None = None
    status: int = 200
    times: int | None = None
    never_ack: bool = False
    delay_ms: float = 0.0

    def matches(self, conversation_id: str, response_id: str) -> bool:
        return (self.conversation_id is None or self.conversation_id == conversation_id) and (
            self.response_id is None or self.response_id == response_id
        )

    @classmethod
    def parse(cls, data: Any, field: str) -> Rule:
        if not isinstance(data, dict):
            raise BehaviourError(field, "must be an object")
        _unknown(data, _RULE_FIELDS, f"{field}.")
        match = data.get("match", {})
        if not isinstance(match, dict):
            raise BehaviourError(f"{field}.match", "must be an object")
        _unknown(match, _MATCH_FIELDS, f"{field}.match.")
        for name, value in match.items():
            if not isinstance(value, str):
                raise BehaviourError(f"{field}.match.{name}", "must be a string")
        if "status" not in data:
            raise BehaviourError(f"{field}.status", "is required")
        status = _integer(data["status"], f"{field}.status", low=0)
        if status not in (200, 202) and not 400 <= status <= 599:
            raise BehaviourError(f"{field}.status", f"must be 200, 202 or 4xx/5xx, got {status}")
        times = data.get("times")
        if times is not None:
            times = _integer(times, f"{field}.times", low=0)
        never_ack = data.get("never_ack", False)
        if not isinstance(never_ack, bool):
            raise BehaviourError(f"{field}.never_ack", "must be a boolean")
        delay_ms = _number(data.get("delay_ms", 0), f"{field}.delay_ms", high=600_000)
        return cls(
            conversation_id=match.get("conversation_id"),
            response_id=match.get("response_id"),
            status=status,
            times=times,
            never_ack=never_ack,
            delay_ms=delay_ms,
        )

    def as_dict(self) -> dict[str, Any]:
        match = {
            name: value
            for name, value in (
                ("conversation_id", self.conversation_id),
                ("response_id", self.response_id),
            )
            if value is not None
        }
        return {
            "match": match,
            "status": self.status,
            "times": self.times,
            "never_ack": self.never_ack,
            "delay_ms": self.delay_ms,
        }


@dataclass(frozen=True, slots=True)
class Behaviour:
    """How the sink answers; replaced as a whole by every configure / PUT."""

    seed: int = 0
    p_recoverable: float = 0.0
    p_timeout: float = 0.0
    p_non_recoverable: float = 0.0
    p_async: float = 0.0
    p_never_ack: float = 0.0
    ack_delay_ms: tuple[float, float] = (20.0, 100.0)
    timeout_sleep_ms: float = 2000.0
    orderly_url: str | None = None
    rules: tuple[Rule, ...] = ()

    @classmethod
    def parse(cls, data: Any) -> Behaviour:
        if not isinstance(data, dict):
            raise BehaviourError("body", "must be a JSON object")
        _unknown(data, _BEHAVIOUR_FIELDS, "")
        seed = _integer(data.get("seed", 0), "seed", low=-(2**63))
        probs = {name: _number(data.get(name, 0.0), name, high=1.0) for name in _PROBABILITIES}
        total = 0.0
        for name in _PROBABILITIES:
            total += probs[name]
            if total > 1.0 + 1e-9:
                raise BehaviourError(
                    name, f"p_recoverable+p_timeout+p_non_recoverable+p_async is {total:g} > 1"
                )
        p_never_ack = _number(data.get("p_never_ack", 0.0), "p_never_ack", high=1.0)
        delays = data.get("ack_delay_ms", [20, 100])
        if not isinstance(delays, list | tuple) or len(delays) != 2:
            raise BehaviourError("ack_delay_ms", "must be [low, high] in milliseconds")
        low = _number(delays[0], "ack_delay_ms", high=600_000)
        high = _number(delays[1], "ack_delay_ms", high=600_000)
        if low > high:
            raise BehaviourError("ack_delay_ms", f"low {low:g} is above high {high:g}")
        timeout_sleep_ms = _number(
            data.get("timeout_sleep_ms", 2000), "timeout_sleep_ms", high=600_000
        )
        orderly_url = data.get("orderly_url")
        if orderly_url is not None and (
            not isinstance(orderly_url, str) or not orderly_url.startswith(("http://", "https://"))
        ):
            raise BehaviourError("orderly_url", "must be an http(s) URL or null")
        raw_rules = data.get("rules", [])
        if not isinstance(raw_rules, list):
            raise BehaviourError("rules", "must be a list")
        rules = tuple(Rule.parse(rule, f"rules[{i}]") for i, rule in enumerate(raw_rules))
        if orderly_url is None:
            if probs["p_async"] > 0 and p_never_ack < 1:
                raise BehaviourError("orderly_url", "is required when p_async > 0")
            for i, rule in enumerate(rules):
                if rule.status == 202 and not rule.never_ack:
                    raise BehaviourError(
                        "orderly_url", f"is required by rules[{i}] (202 with an ACK)"
                    )
        return cls(
            seed=seed,
            p_never_ack=p_never_ack,
            ack_delay_ms=(low, high),
            timeout_sleep_ms=timeout_sleep_ms,
            orderly_url=orderly_url.rstrip("/") if orderly_url else None,
            rules=rules,
            **probs,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "p_recoverable": self.p_recoverable,
            "p_timeout": self.p_timeout,
            "p_non_recoverable": self.p_non_recoverable,
            "p_async": self.p_async,
            "p_never_ack": self.p_never_ack,
            "ack_delay_ms": list(self.ack_delay_ms),
            "timeout_sleep_ms": self.timeout_sleep_ms,
            "orderly_url": self.orderly_url,
            "rules": [rule.as_dict() for rule in self.rules],
        }
