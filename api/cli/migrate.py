"""``orderly migrate``: create or upgrade the database schema."""

from __future__ import annotations

from typing import Annotated

import typer

from orderly.api.cli.common import console
from orderly.worker import readiness
from orderly.worker.db import schema
from orderly.worker.runtime import get_runtime


def migrate(
    create_database: Annotated[
        bool, typer.Option(help="Create the database first if the server lacks it")
    ] = False,
) -> None:
    """Create or upgrade the database schema and seed configuration defaults."""
    runtime = get_runtime()
    if create_database and schema.create_database(runtime.settings.database_url):
        console.print(f"created database {runtime.engine.url.database}")
    readiness.direct_postgresql(runtime.engine)  # before it changes anything
    schema.upgrade(runtime.settings.database_url)
    runtime.startup_check(redis=False)  # migrations need no Redis
    console.print("[green]database is at the latest revision[/]")
