"""``orderly settings [--check]``: the settings in effect (secrets hidden), and with --check
every problem at once: invalid values, unreachable services, a schema behind the code,
handler modules that do not import."""

from __future__ import annotations

import functools
import importlib
import json
import logging
import re
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

import typer
from pydantic import SecretStr

from orderly.api.cli.common import console, err
from orderly.worker.settings import Settings, get_settings

# A query parameter of a URL that holds a credential.
_CREDENTIAL = re.compile(r"(?i)(password|passwd|pwd|secret|token|key)=[^&]*")


def _masked(value: Any) -> Any:
    """A value with any credential in it hidden: a URL's password and credential parameters,
    in nested mappings and lists too."""
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_masked(v) for v in value]
    if not isinstance(value, str) or "://" not in value:
        return value
    parts = urlsplit(value)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}"
    query = _CREDENTIAL.sub(lambda m: f"{m.group(1)}=***", parts.query)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _shown(settings: Settings) -> dict[str, Any]:
    found = {}
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        key = str(getattr(alias, "choices", [alias])[0] or name)
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            value = "(set)" if value.get_secret_value() else "(empty)"
        elif key.endswith(("_PASSWORD", "_SECRET")) and value:
            value = "(set)"
        found[key] = _masked(value)
    return found


def _problems(settings: Settings) -> list[str]:
    from orderly.worker import readiness
    from orderly.worker.db import schema
    from orderly.worker.runtime import Runtime

    runtime = Runtime(settings)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    found = []
    checks = {
        "postgresql": (
            functools.partial(readiness.ping_postgresql, runtime.engine),
            "ORDERLY_DATABASE_URL",
        ),
        "redis": (functools.partial(readiness.ping_redis, runtime.redis), "ORDERLY_REDIS_URL"),
        "broker": (functools.partial(runtime.broker.ping, 5.0), "ORDERLY_BROKER_URL"),
    }
    for service, (check, setting) in checks.items():
        down = readiness.probe(service, check)
        if down is not None:
            found.append(f"{setting}: {down}")
    if not found:
        problem = schema.schema_problem(settings.database_url)
        if problem:
            found.append(f"ORDERLY_DATABASE_URL: {problem}")
    for module in settings.handler_module_list:
        try:
            importlib.import_module(module)
        except Exception as exc:
            found.append(f"ORDERLY_HANDLER_MODULES: {module} does not import: {exc}")
    runtime.engine.dispose()
    return found


def settings(
    check: Annotated[
        bool, typer.Option("--check", help="Check every setting and service; exit 2 on a problem.")
    ] = False,
) -> None:
    """The settings in effect (secrets hidden); --check reports every problem at once (a
    setting that does not validate is reported, each on its line, before any command runs)."""
    current = get_settings()
    if not check:
        console.print_json(json.dumps(_shown(current), default=str))
        return
    found = _problems(current)
    for problem in found:
        err.print(problem, soft_wrap=True, highlight=False)
    if found:
        raise typer.Exit(code=2)
    console.print("settings valid; PostgreSQL, Redis, the schema and the handler modules are ready")
