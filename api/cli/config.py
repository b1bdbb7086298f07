"""``orderly config ...``: read and change the configuration table."""

from __future__ import annotations

from dataclasses import asdict

import typer
from rich.table import Table

from orderly.api.cli.common import AsJson, call, console, print_json
from orderly.worker import configuration
from orderly.worker.runtime import get_runtime

config_app = typer.Typer(help="Read and change the configuration table.", no_args_is_help=True)


@config_app.command("list")
def config_list(as_json: AsJson = False) -> None:
    found = configuration.list_items(get_runtime().engine)
    if as_json:
        return print_json([{**asdict(row), "data_type": row.data_type.value} for row in found])
    table = Table("code", "value", "default", "type", "mandatory", "validation")
    for row in found:
        table.add_row(
            row.code,
            row.current_value or "",
            row.default_value or "",
            row.data_type.value,
            str(row.mandatory),
            row.validation or "",
        )
    console.print(table)


@config_app.command("get")
def config_get(code: str) -> None:
    row = call(configuration.get_item, get_runtime().engine, code)
    value = row.current_value if row.current_value is not None else row.default_value
    console.print(value if value is not None else "")


@config_app.command("set")
def config_set(code: str, value: str) -> None:
    """Set a current value (validated against the item's type and regex)."""
    call(configuration.set_value, get_runtime().engine, code, value)
    console.print(f"{code} = {value}")


@config_app.command("unset")
def config_unset(code: str) -> None:
    """Clear the current value so the default applies."""
    call(configuration.set_value, get_runtime().engine, code, None)
    console.print(f"{code} uses its default")
