"""Reference pages written from the code itself, so that they cannot drift from it: every
setting of the pydantic settings models, every command of the typer tree, every route of the
app's OpenAPI document and every metric of the Prometheus collector. Each function returns
one Markdown page; ``tooling/docs/hooks.py`` adds them to the MkDocs build."""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import typer
from pydantic import AliasChoices
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from typer._click.core import Command, Context, Parameter
from typer.core import TyperArgument, TyperGroup


def _cell(text: str) -> str:
    """Text made safe for one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


# --- settings -------------------------------------------------------------------------------


def aliases(field: FieldInfo) -> list[str]:
    """The environment variables a field is read from, its main name first."""
    alias = field.validation_alias
    if isinstance(alias, str):
        return [alias]
    if isinstance(alias, AliasChoices):
        return [c for c in alias.choices if isinstance(c, str)]
    return []


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type) and not isinstance(annotation, types.GenericAlias):
        return annotation.__name__
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    return re.sub(r"\b(typing|collections\.abc)\.", "", str(annotation)).replace("|", "\\|")


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        factory = field.default_factory
        name = getattr(factory, "__name__", repr(factory))
        return "the hostname" if name == "gethostname" else f"computed (`{name}`)"
    if field.default is PydanticUndefined:
        return "(required)"
    if field.default is None or field.default == "":
        return "(none)"
    return f"`{field.default!r}`" if not isinstance(field.default, str) else f"`{field.default}`"


def _bounds(field: FieldInfo) -> str:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥"}
    found = []
    for item in field.metadata:
        for attr, sign in words.items():
            value = getattr(item, attr, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return ", ".join(found)


def settings_fields() -> Iterator[tuple[type, str, FieldInfo]]:
    """Every field of every settings section, each once, in the sections' order."""
    from orderly.worker.settings import SECTIONS

    seen: set[str] = set()
    for section in SECTIONS:
        for name, field in section.model_fields.items():
            if name not in seen:
                seen.add(name)
                yield section, name, field


def settings_page() -> str:
    fields = list(settings_fields())
    undescribed = sorted(aliases(f)[0] for _, _, f in fields if not f.description)
    if undescribed:
        raise ValueError(f"settings without a description (description=...): {undescribed}")
    lines = [
        "# Settings",
        "",
        "Generated from the settings models in `worker/settings/` when the site is built.",
        "Every setting is an environment variable (or a line of a `.env` file in the working",
        "directory). An invalid value stops the process with a message naming the variable;",
        "`orderly settings --check` reports every problem at once, and `orderly settings`",
        "prints the settings in effect with secrets hidden.",
        "",
        "The `AURA_QUEUE_MANAGER_*` variables keep the names, units and defaults of the ordered",
        "response specification; the spelling `AURA_QUEUE_QUEUE_MANAGER_*` is read too.",
        "",
    ]
    section: type | None = None
    for owner, _name, field in fields:
        if owner is not section:
            section = owner
            module = inspect.getmodule(owner)
            doc = inspect.getdoc(module) or ""
            lines += [
                "",
                f"## {owner.__name__}",
                "",
                f"`{owner.__module__}`: {_cell(doc)}",
                "",
                "| variable | type | default | bounds | meaning |",
                "|---|---|---|---|---|",
            ]
        names = aliases(field)
        if not names:
            continue
        main, *others = names
        meaning = field.description or ""
        if others:
            meaning += " Also read as " + ", ".join(f"`{o}`" for o in others) + "."
        lines.append(
            f"| `{main}` | {_type_name(field.annotation)} | {_cell(_default(field))} "
            f"| {_bounds(field)} | {_cell(meaning)} |"
        )
    return "\n".join(lines) + "\n"


# --- the command line -----------------------------------------------------------------------
# Typer carries its own copy of click (typer._click): the tree is walked through Typer's classes.


def cli_root() -> TyperGroup:
    from orderly.api.cli import app

    command = typer.main.get_command(app)
    assert isinstance(command, TyperGroup)
    return command


def subcommands(group: TyperGroup) -> list[tuple[str, Command]]:
    return [(name, c) for name, c in group.commands.items() if not c.hidden]


def cli_commands(
    group: TyperGroup | None = None, prefix: str = "orderly"
) -> Iterator[tuple[str, Command]]:
    """Every command of the tree as (full name, command), each group before its commands."""
    for name, command in subcommands(group or cli_root()):
        full = f"{prefix} {name}"
        yield full, command
        if isinstance(command, TyperGroup):
            yield from cli_commands(command, full)


def _param_row(param: Parameter) -> str:
    if isinstance(param, TyperArgument):
        name = f"`{(param.metavar or param.name or '').upper()}`"
        kind = "argument"
    else:
        name = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
        kind = "flag" if getattr(param, "is_flag", False) else "option"
    if param.required:
        kind += ", required"
    help_text = getattr(param, "help", None) or ""
    default = param.default
    shown = "" if default in (None, False, (), []) or callable(default) else f"`{default}`"
    return f"| {name} | {kind} | {_cell(str(shown))} | {_cell(help_text)} |"


def _usage(full: str, command: Command) -> str:
    pieces = command.collect_usage_pieces(Context(command, info_name=full))
    return " ".join([full, *pieces])


def cli_page() -> str:
    lines = [
        "# Command line",
        "",
        "Generated from the `orderly` command tree (`api/cli/`) when the site is built. Every",
        "command takes `--help`; `orderly --version` prints the version. A service a command",
        "cannot reach is one line naming the setting to fix (`error: PostgreSQL cannot be",
        "reached (...): check ORDERLY_DATABASE_URL`).",
        "",
    ]
    for full, command in cli_commands():
        depth = full.count(" ")
        lines += ["", f"{'#' * min(depth + 1, 4)} `{full}`", ""]
        help_text = inspect.cleandoc(command.help or command.short_help or "")
        if help_text:
            lines += [help_text, ""]
        lines += ["```text", _usage(full, command), "```", ""]
        if isinstance(command, TyperGroup):
            lines += ["| command | what it does |", "|---|---|"]
            lines += [
                f"| `{full} {n}` | {_cell(c.get_short_help_str(200))} |"
                for n, c in subcommands(command)
            ]
            lines.append("")
        params = [p for p in command.params if p.name != "help" and not getattr(p, "hidden", False)]
        if params:
            lines += ["| parameter | kind | default | meaning |", "|---|---|---|---|"]
            lines += [_param_row(p) for p in params]
    return "\n".join(lines) + "\n"


# --- the HTTP API ---------------------------------------------------------------------------

METHODS = ("get", "post", "put", "patch", "delete")


def openapi() -> dict[str, Any]:
    from orderly.api.http import create_app

    document: dict[str, Any] = create_app().openapi()
    return document


def routes(document: Mapping[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(METHOD, path, operation) for every operation of the document."""
    for path, item in document["paths"].items():
        for method in METHODS:
            if method in item:
                yield method.upper(), path, item[method]


def _security(operation: Mapping[str, Any]) -> str:
    found = []
    for requirement in operation.get("security", []):
        for scheme, scopes in requirement.items():
            found.append(f"{scheme}: " + ", ".join(f"`{s}`" for s in scopes) if scopes else scheme)
    return "; ".join(found) or "none"


def _body(operation: Mapping[str, Any]) -> str:
    content = operation.get("requestBody", {}).get("content", {})
    for kind, media in content.items():
        ref = media.get("schema", {}).get("$ref", "")
        return f"`{ref.rsplit('/', 1)[-1]}` ({kind})" if ref else kind
    return ""


def http_page() -> str:
    document = openapi()
    lines = [
        "# HTTP API",
        "",
        "Generated from the app's OpenAPI document when the site is built. The running API",
        "serves the same document at `GET /openapi.json` and Swagger UI at `GET /docs` (served",
        "by orderly itself, usable offline); this site carries a copy:",
        "[openapi.json](openapi.json).",
        "",
        "Every route but `/health`, `/ready` and `POST /acks/{async_response_id}` needs an API",
        "key with the scope named below (`Authorization: Bearer orderly_...`). Every refusal has",
        'one shape: `{"errors": [{"field": ..., "problem": ...}]}`.',
        "",
    ]
    for name, scheme in document.get("components", {}).get("securitySchemes", {}).items():
        lines.append(f"- **{name}**: {_cell(scheme.get('description', ''))}")
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for method, path, operation in routes(document):
        tag = (operation.get("tags") or ["other"])[0]
        by_tag.setdefault(tag, []).append((method, path, operation))
    for tag, operations in by_tag.items():
        lines += ["", f"## {tag[:1].upper()}{tag[1:]}", ""]
        lines += ["| route | what it does | scope | body | answers |", "|---|---|---|---|---|"]
        for method, path, operation in operations:
            doc = operation.get("description") or operation.get("summary", "")
            first = doc.split("\n\n", 1)[0]
            answers = ", ".join(sorted(operation.get("responses", {})))
            lines.append(
                f"| `{method} {path}` | {_cell(first)} | {_cell(_security(operation))} "
                f"| {_cell(_body(operation))} | {answers} |"
            )
    schemas = document.get("components", {}).get("schemas", {})
    lines += ["", "## Schemas", "", "The request and answer bodies named above.", ""]
    for name, schema in sorted(schemas.items()):
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fields = ", ".join(f"`{p}`" + ("*" if p in required else "") for p in props)
        lines.append(f"- **{name}**: {fields or _cell(schema.get('type', ''))}")
    lines += ["", "(`*`: required.)"]
    return "\n".join(lines) + "\n"


def openapi_json() -> str:
    return json.dumps(openapi(), indent=1, sort_keys=False)


# --- metrics --------------------------------------------------------------------------------


def _every_figure() -> Any:
    """Figures with every part present, so that the collector yields every family."""
    from orderly.models.enums import MessageState
    from orderly.models.pubsub import DeliveryState
    from orderly.worker.observe import (
        BlockReason,
        BrokerFigures,
        ConversationFigures,
        Figures,
        StoreFigures,
    )
    from orderly.worker.totals import CATALOGUE, Counter, Total
    from orderly.worker.tracking import Histogram, TrackingSnapshot

    histogram = Histogram(count=1, sum_ms=1, max_ms=1, buckets=((1.0, 1), (float("inf"), 1)))
    totals = []
    for spec in CATALOGUE:  # one series of each counter and histogram
        labels = dict.fromkeys(spec.labels, "x")
        if isinstance(spec, Counter):
            totals.append(Total(spec.name, labels, 0.0))
        else:
            totals.append(Total(f"{spec.name}_bucket", {**labels, "le": "+Inf"}, 0.0))
            totals.append(Total(f"{spec.name}_sum", labels, 0.0))
    return Figures(
        store=StoreFigures(
            messages={s: 0 for s in MessageState},
            deliveries={s: 0 for s in DeliveryState},
            deliveries_delayed=0,
            oldest_blocked_head_age_s=0.0,
        ),
        conversations=ConversationFigures(
            open=0,
            responses_undelivered=0,
            blocked={r: 0 for r in BlockReason},
            ready=0,
            in_flight=0,
            awaited=0,
            scheduled=0,
            awaited_due=0,
            blocked_head_msg_ids=(),
            oldest_blocked_head_age_s=0.0,
        ),
        tracking=TrackingSnapshot(
            done=histogram,
            timeout=histogram,
            overflow=0,
            expired=0,
            retried=0,
            gave_up=0,
            listed=0,
            done_waiting=0,
        ),
        workers_alive={"node": 1},
        broker=BrokerFigures(queues={"orderly.process": 0}, unacked=0),
        totals=totals,
    )


def metric_families() -> list[tuple[str, str, str, list[str]]]:
    """(exposed name, type, help, labels) of every family the collector can yield."""
    from orderly.api.metrics import families

    found = []
    for family in families(_every_figure()):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = sorted({k for sample in family.samples for k in sample.labels if k not in ("le",)})
        found.append((name, family.type, family.documentation, labels))
    return found


def metrics_page() -> str:
    lines = [
        "# Metrics",
        "",
        "Generated from the Prometheus collector (`api/metrics.py`) when the site is built.",
        "`GET /metrics` on the API (scope `metrics`) answers Prometheus text",
        "(`text/plain; version=0.0.4`, or OpenMetrics when the scraper asks for it). The gauges",
        "are read from PostgreSQL and Redis at every scrape; a source that cannot be read is",
        "left out and `orderly_source_up{source}` is 0 for it. The counters and histograms are",
        "counted by the process where it happens (a worker's handler runs and sends, the API's",
        "requests) and added to running totals in PostgreSQL every `ORDERLY_METRICS_FLUSH_S`:",
        "the cluster's sum, never lowered by a purge or a restart. `orderly status` prints the",
        "gauges as tables. Alert rules and a Grafana dashboard over these names ship in",
        "`deploy/` (see the operations guide).",
        "",
        "| metric | type | labels | what it counts |",
        "|---|---|---|---|",
    ]
    for name, kind, doc, labels in metric_families():
        shown = ", ".join(f"`{label}`" for label in labels)
        suffix = " (`_bucket`, `_sum`, `_count`)" if kind == "histogram" else ""
        lines.append(f"| `{name}`{suffix} | {kind} | {shown} | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


PAGES = {
    "reference/settings.md": settings_page,
    "reference/cli.md": cli_page,
    "reference/http-api.md": http_page,
    "reference/metrics.md": metrics_page,
    "reference/openapi.json": openapi_json,
}
