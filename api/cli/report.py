"""``orderly report``: the Spark report over the message store (reports.job)."""

from __future__ import annotations

from typing import Annotated

import typer

from orderly.api.cli.common import require_extra


def report(
    since: Annotated[str | None, typer.Option(help="Window start (ISO; UTC if no offset).")] = None,
    until: Annotated[str | None, typer.Option(help="Window end, exclusive.")] = None,
    incremental: Annotated[
        bool,
        typer.Option(
            help="Read only rows after the stored watermark, then move it (the default without "
            "--since, --until or --full)."
        ),
    ] = False,
    full: Annotated[
        bool, typer.Option(help="Read the whole store; the watermark stays where it is.")
    ] = False,
    watermark: Annotated[str, typer.Option(help="The watermark's name.")] = "default",
    lag_minutes: Annotated[
        float,
        typer.Option(help="Incremental: leave out the last minutes (rows not yet committed)."),
    ] = 1.0,
    output_dir: Annotated[
        str | None, typer.Option(help="Default: ORDERLY_REPORT_OUTPUT_DIR.")
    ] = None,
    to_postgres: Annotated[
        bool, typer.Option(help="Also append the aggregates to report_* tables.")
    ] = False,
    master: Annotated[
        str | None, typer.Option(help="Spark master (local[*], spark://...).")
    ] = None,
) -> None:
    """Spark report over the message store: Parquet, CSV and one HTML file per run."""
    require_extra("reports", "pyspark", "matplotlib")
    # Imported here: Spark is loaded only by the command that uses it.
    from orderly.reports.job import main as report_main

    argv = ["--watermark", watermark, "--lag-minutes", str(lag_minutes)]
    for flag, value in (
        ("--since", since),
        ("--until", until),
        ("--output-dir", output_dir),
        ("--master", master),
    ):
        if value is not None:
            argv += [flag, value]
    if incremental:
        argv.append("--incremental")
    if full:
        argv.append("--full")
    if to_postgres:
        argv.append("--to-postgres")
    raise typer.Exit(report_main(argv))
