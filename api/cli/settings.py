"""``orderly settings [--check]``: the settings in effect (secrets hidden), and with --check
every problem at once: invalid values, unreachable services, a schema behind the code,
handler modules that do not import."""

from __future__ import annotations

import functools
import importlib
import json
import logging
from typing import Annotated, Any

import typer
from pydantic import SecretStr

from api.cli.common import console, err
from worker.settings import Settings, get_settings


def _shown(settings: Settings) -> dict[str, Any]:
    found = {}
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        key = str(getattr(alias, "choices", [alias])[0] or name)
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            value = "(set)" if value.get_secret_value() else "(empty)"
        elif any(word in key for word in ("PASSWORD", "SECRET", "TOKEN")) and value:
            value = "(set)"
        elif name in ("database_url", "redis_url", "broker_url") and value:
            from sqlalchemy import make_url

            try:
                value = make_url(str(value)).render_as_string(hide_password=True)
            except Exception:
                value = "(set)"
        found[key] = value
    return found


def _ping_broker(timeout_s: float) -> None:
    from worker.celery import ping_broker

    ping_broker(timeout_s)


def _problems(settings: Settings) -> list[str]:
    from worker import readiness
    from worker.runtime import Runtime
    from worker.store import schema

    runtime = Runtime(settings)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    found = []
    checks = {
        "postgresql": (
            functools.partial(readiness.ping_postgresql, runtime.engine),
            "ORDERLY_DATABASE_URL",
        ),
        "redis": (functools.partial(readiness.ping_redis, runtime.redis), "ORDERLY_REDIS_URL"),
        "broker": (functools.partial(_ping_broker, 5.0), "ORDERLY_BROKER_URL"),
    }
    for service, (check, setting) in checks.items():
        down = readiness.probe(service, check)
        if down is not None:
            found.append(f"{setting}: {down}")
    if not found:
        behind = schema.pending_revisions(settings.database_url)
        if behind:
            found.append(f"ORDERLY_DATABASE_URL: migrations not applied: {', '.join(behind)}")
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
