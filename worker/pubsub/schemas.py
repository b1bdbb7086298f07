"""Event types' JSON schemas: what registration refuses, and a validation whose reach and cost
stay bounded whatever schema and payload it is given.

The schema comes from whoever registers the event type, the payload from whoever publishes;
both are handled in the API's process, so neither may make it fetch, read files or spin:

- ``$ref`` (and ``$dynamicRef``, ``$recursiveRef``) resolve inside the schema's own document
  only (``#/$defs/x``, ``#/definitions/x``, an ``$anchor``). The registry behind every
  validator retrieves nothing: no URI is fetched over the network or read from a file.
  Registration resolves every reference first and refuses one that leads nowhere, naming it;
  a schema stored before that check refuses its publishes, naming the reference, instead.
- ``pattern`` and ``patternProperties`` run in RE2 (google-re2): Python's ``re`` backtracks,
  and ``^(a+)+$`` against 27 characters takes seconds. RE2's worst case is the text's length
  times the pattern's program size (``[ab]*a[ab]{1000}c`` against a megabyte: 10 s), so a
  match whose product is over :data:`MAX_PATTERN_WORK` is refused without being tried. A
  pattern RE2 cannot run (a backreference, a lookaround) or longer than
  :data:`MAX_PATTERN_CHARS` is refused at registration.
- ``uniqueItems`` compares items by a hashable canonical form, in time linear in the array
  (jsonschema compares unsortable items pairwise: 3,000 objects took 18 s). An array longer
  than ``ORDERLY_SCHEMA_MAX_UNIQUE_ITEMS`` under it is refused without being compared.
- A validation runs under a budget of CPU time, ``ORDERLY_SCHEMA_VALIDATION_BUDGET_MS``:
  ``anyOf`` or ``oneOf`` over a recursive ``$ref`` can cost exponentially in the payload's
  depth, so the validator counts its steps and stops, refusing, once the budget is spent.
  CPU time, not wall time: a busy machine does not refuse what an idle one accepts.
  Registration validates a few trivial values under the budget, which refuses a schema that
  is expensive whatever the payload. A schema nests at most :data:`MAX_SCHEMA_DEPTH` levels.
"""

from __future__ import annotations

import contextvars
import functools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jsonschema
import re2
import referencing
import referencing.exceptions
import referencing.jsonschema
from jsonschema.exceptions import ValidationError

from orderly.worker.core.errors import InvalidMessage
from orderly.worker.settings import get_settings
from orderly.worker.settings.pubsub import PubSubSettings

if TYPE_CHECKING:
    from referencing._core import Resolver

# Far beyond any pattern written by hand; RE2's program grows with the pattern.
MAX_PATTERN_CHARS = 1_000
# Text length times program size: about a second in RE2's slowest mode.
MAX_PATTERN_WORK = 100_000_000
# As deep as a request body may be (api.http.common.MAX_DEPTH): the checks recurse.
MAX_SCHEMA_DEPTH = 64
# Values every schema is validated against at registration, under the budget.
SAMPLES: tuple[Any, ...] = ({}, [], "", 0, None)
UNIQUE_SETTING = "ORDERLY_SCHEMA_MAX_UNIQUE_ITEMS"
BUDGET_SETTING = "ORDERLY_SCHEMA_VALIDATION_BUDGET_MS"
_REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is reported to its author, not logged


@dataclass(frozen=True)
class Limits:
    """What one validation may cost (the settings of the same names)."""

    max_unique_items: int  # ORDERLY_SCHEMA_MAX_UNIQUE_ITEMS
    budget_ms: int  # ORDERLY_SCHEMA_VALIDATION_BUDGET_MS


def configured_limits(settings: PubSubSettings | None = None) -> Limits:
    """The limits of ``settings`` (a runtime's), else of the process's environment."""
    chosen = settings or get_settings()
    return Limits(chosen.schema_max_unique_items, chosen.schema_validation_budget_ms)


# --- the budget -------------------------------------------------------------------------------


class _Refused(Exception):
    """A limit reached on ``instance``: the whole validation stops (an error yielded under
    ``not`` or ``anyOf`` could let the payload pass)."""

    def __init__(self, instance: Any, problem: str) -> None:
        super().__init__(problem)
        self.instance = instance
        self.problem = problem


class _OverBudget(Exception):
    pass


@dataclass
class _Run:
    limits: Limits
    deadline: float  # of time.thread_time(), which a thread waiting for the GIL does not use
    steps: int = 0


_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("schema_run", default=None)
# A clock read costs about a microsecond, a step a few: look every few dozen steps.
_STEPS_PER_LOOK = 32
# The keywords that validate values against subschemas: whatever repeats goes through them.
_APPLICATORS = frozenset(
    {"$ref", "$dynamicRef", "$recursiveRef", "allOf", "anyOf", "oneOf", "not", "if"}
    | {"items", "prefixItems", "additionalItems", "contains", "unevaluatedItems"}
    | {"properties", "patternProperties", "additionalProperties", "propertyNames"}
    | {"dependentSchemas", "dependencies", "unevaluatedProperties"}
)


def _step() -> None:
    current = _RUN.get()
    if current is not None:
        current.steps += 1
        if current.steps % _STEPS_PER_LOOK == 0 and time.thread_time() > current.deadline:
            raise _OverBudget


def _budgeted(keyword: Callable[..., Any]) -> Callable[..., Any]:
    def run(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _step()
        return keyword(validator, value, instance, schema)

    return run


# --- patterns in RE2 --------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> Any:
    return re2.compile(pattern, _OPTIONS)


def _search(pattern: str, text: str, instance: Any) -> bool | None:
    """Does ``pattern`` occur in ``text``; None when RE2 cannot run it (a schema registered
    before patterns were checked)."""
    try:
        compiled = _compiled(pattern)
    except re2.error:
        return None
    work = len(text) * compiled.programsize
    if work > MAX_PATTERN_WORK:
        raise _Refused(
            instance,
            f"{len(text):,} characters are not matched against {pattern[:80]!r}: its program"
            f" of {compiled.programsize:,} steps times the length is over"
            f" {MAX_PATTERN_WORK:,}",
        )
    _step()
    return bool(compiled.search(text))


def _unrunnable(pattern: str) -> ValidationError:
    return ValidationError(
        f"the event type's schema holds {pattern[:80]!r}, which cannot run in linear time: "
        "register a new version without backreferences or lookarounds"
    )


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "string"):
        return
    found = _search(pattern, instance, instance)
    if found is None:
        yield _unrunnable(pattern)
    elif not found:
        yield ValidationError(f"{instance[:80]!r} does not match {pattern[:80]!r}")


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for name, value in instance.items():
            found = _search(pattern, name, instance)
            if found is None:
                yield _unrunnable(pattern)
                return
            if found:
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _patterns(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every regular expression a schema holds, with where it is."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}"
            if key == "pattern" and isinstance(value, str):
                yield here, value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from ((f"{here}.{p}", p) for p in value)
            yield from _patterns(value, here)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _patterns(value, f"{path}[{index}]")


def _check_patterns(schema: Any) -> None:
    for where, pattern in _patterns(schema, "schema"):
        if len(pattern) > MAX_PATTERN_CHARS:
            raise InvalidMessage(
                where, f"{len(pattern):,} characters: a pattern has at most {MAX_PATTERN_CHARS:,}"
            )
        try:
            _compiled(pattern)
        except re2.error as exc:
            why = exc.args[0] if exc.args else exc
            if isinstance(why, bytes):
                why = why.decode("utf-8", "replace")
            raise InvalidMessage(
                where,
                f"{pattern[:80]!r} cannot be used: {why} (patterns run in RE2, in linear time:"
                " no backreferences or lookarounds)",
            ) from None


# --- uniqueItems in linear time ---------------------------------------------------------------


def _canonical(value: Any) -> Any:
    """A hashable form, equal for equal JSON values: 1 and 1.0 alike, true and 1 not."""
    if isinstance(value, bool):
        return (bool, value)
    if isinstance(value, list):
        return (list, tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return (dict, frozenset((k, _canonical(v)) for k, v in value.items()))
    return value


def _unique_items(
    validator: Any, unique: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not unique or not validator.is_type(instance, "array"):
        return
    current = _RUN.get()
    if current is not None and len(instance) > (limit := current.limits.max_unique_items):
        raise _Refused(
            instance,
            f"uniqueItems over {limit:,} items is not validated: this array holds"
            f" {len(instance):,} (limit {UNIQUE_SETTING})",
        )
    seen: dict[Any, int] = {}
    for index, item in enumerate(instance):
        first = seen.setdefault(_canonical(item), index)
        if first != index:
            yield ValidationError(f"items {first} and {index} are equal (uniqueItems)")
            return


# --- references: inside the document, never retrieved -----------------------------------------


def _retrieve_nothing(uri: str) -> referencing.Resource[Any]:
    raise referencing.exceptions.NoSuchResource(ref=uri)  # type: ignore[call-arg]


# Holds nothing, retrieves nothing: a reference resolves inside its schema's document (while
# validating, jsonschema adds the metaschemas it carries in memory).
_REGISTRY: referencing.Registry[Any] = referencing.Registry(
    retrieve=_retrieve_nothing  # type: ignore[call-arg]
)


def _unresolvable(ref: str) -> str:
    return (
        f"{ref!r} does not resolve inside the schema: a $ref may point only into the schema"
        " itself (#/$defs/name, #/definitions/name, an $anchor); orderly never fetches a"
        " schema from elsewhere"
    )


def _nodes(node: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Every object and array of a schema with where it is; refused past MAX_SCHEMA_DEPTH."""
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidMessage(path, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _nodes(value, f"{path}.{key}", depth + 1)
    elif isinstance(node, list):
        yield path, node
        for index, value in enumerate(node):
            yield from _nodes(value, f"{path}[{index}]", depth + 1)


def check_references(schema: Any) -> None:
    """Refuse a schema with a reference that does not resolve inside its own document, naming
    where it is. References are followed: a ``$ref`` to ``#/x`` checks the ones under x."""
    where = {id(node): path for path, node in _nodes(schema, "schema")}
    cls = jsonschema.validators.validator_for(schema)
    dialect = referencing.jsonschema.specification_with(
        cls.ID_OF(cls.META_SCHEMA) or "urn:unknown-dialect",
        default=referencing.Specification.OPAQUE,
    )
    root = dialect.create_resource(schema)
    todo: list[tuple[referencing.Resource[Any], Resolver[Any]]] = [
        (root, _REGISTRY.resolver_with_root(root))
    ]
    seen: set[int] = set()
    while todo:
        resource, resolver = todo.pop()
        contents = resource.contents
        if id(contents) in seen or id(contents) not in where:
            continue  # walked already, or a boolean schema
        seen.add(id(contents))
        for keyword in _REF_KEYWORDS:
            ref = contents.get(keyword) if isinstance(contents, dict) else None
            if not isinstance(ref, str):
                continue
            try:
                resolved = resolver.lookup(ref)
            except referencing.exceptions.Unresolvable:
                raise InvalidMessage(
                    f"{where[id(contents)]}.{keyword}", _unresolvable(ref)
                ) from None
            todo.append((dialect.create_resource(resolved.contents), resolved.resolver))
        for sub in resource.subresources():
            todo.append((sub, resolver.in_subresource(sub)))


# --- validators -------------------------------------------------------------------------------

_KEYWORDS = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "uniqueItems": _unique_items,
}


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str) -> Any:
    schema = json.loads(schema_text)
    base = jsonschema.validators.validator_for(schema)
    keywords = {**base.VALIDATORS, **_KEYWORDS}
    bounded = jsonschema.validators.extend(
        base,
        {
            name: _budgeted(keyword) if name in _APPLICATORS else keyword
            for name, keyword in keywords.items()
        },
    )
    return bounded(schema, registry=_REGISTRY)


def validator(schema: Any, version: tuple[int, int] | None = None) -> Any:
    """A validator of this schema whose references never leave it and whose patterns run in
    RE2: one per event type version (``version``: its id and number; a registered version
    never changes), else one per distinct schema. :func:`errors` runs it within limits."""
    if version is None:
        return _validator(json.dumps(schema, sort_keys=True))
    return _by_version(version, schema)


# (event type id, version) -> (its schema, its validator); the schema is compared on use, so
# a database whose ids were given out again (a restore) never gets another version's rules.
_VERSIONS: dict[tuple[int, int], tuple[Any, Any]] = {}


def _by_version(version: tuple[int, int], schema: Any) -> Any:
    found = _VERSIONS.get(version)
    if found is None or found[0] != schema:
        if len(_VERSIONS) >= 1024:
            _VERSIONS.clear()
        found = _VERSIONS[version] = (schema, _validator(json.dumps(schema, sort_keys=True)))
    return found[1]


# --- validating -------------------------------------------------------------------------------


def _best_error(validate: Any, payload: Any, limits: Limits) -> ValidationError | None:
    """The most relevant failure, within the limits (raising when one is reached)."""
    token = _RUN.set(_Run(limits, time.thread_time() + limits.budget_ms / 1000))
    try:
        return jsonschema.exceptions.best_match(validate.iter_errors(payload))
    finally:
        _RUN.reset(token)


def _path_of(target: Any, node: Any, path: str) -> str | None:
    if node is target:
        return path
    if isinstance(node, dict):
        children = [(f"{path}.{k}", v) for k, v in node.items()]
    elif isinstance(node, list):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(node)]
    else:
        return None
    for child_path, child in children:
        found = _path_of(target, child, child_path)
        if found is not None:
            return found
    return None


def _ref_of(exc: referencing.exceptions.Unresolvable) -> str:
    return str(getattr(exc, "ref", exc))


def errors(validate: Any, payload: Any, limits: Limits) -> tuple[str, str] | None:
    """The payload's most relevant failure against a validator of :func:`validator`, as
    ``(field, problem)``, or None when it is valid. A limit reached, or a reference leading
    out of the schema, stops the validation and is the failure, naming it."""
    try:
        error = _best_error(validate, payload, limits)
    except _Refused as exc:
        try:
            where = _path_of(exc.instance, payload, "payload")
        except RecursionError:
            where = None
        return where or "payload", exc.problem
    except _OverBudget:
        return "payload", (
            f"validating it against the event type's schema took over {limits.budget_ms:,} ms"
            f" of CPU and was stopped (limit {BUDGET_SETTING})"
        )
    except referencing.exceptions.Unresolvable as exc:
        return "event_type", (
            f"its schema holds {_unresolvable(_ref_of(exc))}: register a new version whose"
            " references point inside it"
        )
    except RecursionError:
        return "payload", "nested too deeply for the event type's schema to validate"
    if error is None:
        return None
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    # jsonschema's messages quote the whole value, which may be most of a megabyte
    message = error.message if len(error.message) <= _MESSAGE_CHARS else _shortened(error.message)
    return "payload" + path, message


_MESSAGE_CHARS = 500


def _shortened(message: str) -> str:
    return f"{message[: _MESSAGE_CHARS // 2]} ... {message[-_MESSAGE_CHARS // 2 :]}"


def check(schema: Any, limits: Limits | None = None) -> None:
    """Refuse a schema orderly will not run, naming where the problem is: nested too deep, a
    pattern RE2 cannot run or too long, not a JSON schema, a reference leading out of it, or
    validating a trivial value over the budget. Nothing here fetches or reads anything."""
    for _ in _nodes(schema, "schema"):  # too deep is refused before the other checks recurse
        pass
    _check_patterns(schema)
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidMessage("schema", f"not a valid JSON schema: {exc.message}") from None
    check_references(schema)
    limits = limits or configured_limits()
    validate = validator(schema)
    for sample in SAMPLES:
        try:
            _best_error(validate, sample, limits)
        except _OverBudget:
            raise InvalidMessage(
                "schema",
                f"validating even {json.dumps(sample)} against it takes over"
                f" {limits.budget_ms:,} ms of CPU (limit {BUDGET_SETTING})",
            ) from None
        except RecursionError:
            raise InvalidMessage(
                "schema", "refers to itself without end (a $ref loop that reads nothing)"
            ) from None
