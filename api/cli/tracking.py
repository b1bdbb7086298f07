"""``orderly track ...``: message tracking from the command line."""

from __future__ import annotations

from typing import Annotated

import typer

from orderly.api.cli.common import AsJson, call, console, print_json
from orderly.worker.messages.done_reports import report_done
from orderly.worker.runtime import get_runtime

track_app = typer.Typer(help="Message tracking: report tracked work done.", no_args_is_help=True)


@track_app.command("done")
def track_done(
    xid: Annotated[str, typer.Argument(help="the work's xid: a message's msg_id, a meta id")],
    as_json: AsJson = False,
) -> None:
    """Report done the tracked work known by its xid (the seed's ``:message:xid:$xid``): the
    timeout monitor counts it done and never times it out."""
    runtime = get_runtime()
    done = call(report_done, runtime.engine, runtime.tracker, {"xid": xid}, None)
    if as_json:
        return print_json({"xid": done.xid, "track_id": done.track_id, "outcome": done.outcome})
    console.print(f"{done.xid}: tracking id {done.track_id}, {done.outcome}")
