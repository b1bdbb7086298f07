"""What the command lines share: their consoles, how results and errors are printed, how JSON
options are read, and :func:`run`, which turns orderly's errors into exit code 2 (3 for a
message that conflicts with the one stored under its ids: :func:`exit_code`)."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from collections.abc import Callable
from datetime import date, datetime
from typing import Annotated, Any, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from orderly.worker.core import logs
from orderly.worker.core.errors import ConflictingMessage, OrderlyError, first_line
from orderly.worker.settings import get_settings

# Piped or redirected, a table is as wide as its rows (no codes or URLs cut at 80 columns).
PIPED_WIDTH = 1000
console = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
err = Console(stderr=True, width=None if sys.stderr.isatty() else PIPED_WIDTH)

AsJson = Annotated[bool, typer.Option("--json", help="The rows as JSON, as the API answers them")]


def print_json(value: Any) -> None:
    """One JSON document on stdout (dates and times in ISO 8601, as the API writes them)."""
    console.print_json(json.dumps(value, default=_iso, ensure_ascii=False))


def _iso(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    return str(value)


T = TypeVar("T")

# Exit codes of a refusal: input, state or a service (2); a message that conflicts with the
# one stored under its (correlation_id, source_system), which sending it again cannot fix (3).
EXIT_REFUSED = 2
EXIT_CONFLICT = 3


def exit_code(exc: Exception) -> int:
    """The exit code a command that ``exc`` refused ends with."""
    return EXIT_CONFLICT if isinstance(exc, ConflictingMessage) else EXIT_REFUSED


def show_result(msg_id: int, state: str, verb: str, **more: Any) -> None:
    console.print_json(json.dumps({"msg_id": msg_id, "state": state, "result": verb, **more}))


def fail(exc: Exception) -> typer.Exit:
    """Print the error on one line; the caller raises what this returns (:func:`exit_code`)."""
    err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
    return typer.Exit(code=exit_code(exc))


def require_extra(extra: str, *modules: str) -> None:
    """Exit 2 with one line naming the extra to install when one of ``modules`` is missing
    (the optional parts: Spark and matplotlib for reports, Flower for the dashboard)."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        err.print(
            f"[bold red]error:[/] {', '.join(missing)} not installed: "
            + escape(f"pip install 'orderly[{extra}]'"),
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(code=2)


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``; an orderly error is printed and the command exits 2 (or 3)."""
    try:
        return fn(*args, **kwargs)
    except OrderlyError as exc:
        raise fail(exc) from None


def parse_payload(text: str | None) -> Any:
    """A payload option: JSON if it parses, else the text itself."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # plain text is a string payload


def json_option(value: str, field: str) -> Any:
    """An option that must hold JSON (``-`` reads stdin); malformed JSON fails naming ``field``."""
    text = sys.stdin.read() if value == "-" else value
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(ValueError(f"{field}: malformed JSON: {exc}")) from None


def _unreachable(exc: Exception) -> tuple[str, str] | None:
    """The service a driver error says is unreachable, and the setting that points at it."""
    import kombu.exceptions
    import redis.exceptions

    from orderly.worker.db.db import connection_lost

    if connection_lost(exc):
        return "PostgreSQL", "ORDERLY_DATABASE_URL"
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return "Redis", "ORDERLY_REDIS_URL"
    if isinstance(exc, kombu.exceptions.OperationalError):
        return "the broker", "ORDERLY_BROKER_URL (default: ORDERLY_REDIS_URL)"
    return None


def run(app: typer.Typer) -> None:
    """Run a command line with logging from the settings. An orderly error that escapes a
    command, settings that do not validate, or a service that cannot be reached end it with
    one red line (naming the setting to fix) and exit code 2 (3: :func:`exit_code`)."""
    try:
        settings = get_settings()
        logs.configure(settings.log_level, settings.log_format, node=settings.node_code)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
        app()
    except OrderlyError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise SystemExit(exit_code(exc)) from None
    except ValidationError as exc:
        # Every problem, each on its line, naming its variable.
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "settings"
            err.print(f"[bold red]invalid setting[/] {where}: {error['msg']}", soft_wrap=True)
        raise SystemExit(2) from None
    except Exception as exc:
        found = _unreachable(exc)
        if found is None:
            raise
        service, setting = found
        reason = first_line(getattr(exc, "orig", None) or exc)
        line = f"[bold red]error:[/] {service} cannot be reached ({reason}): check {setting}"
        err.print(line, soft_wrap=True)
        raise SystemExit(2) from None
