"""``orderly node ...``: list nodes and move them between RUN, drain and STOPPED."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from orderly.api.cli.common import AsJson, call, console, err, print_json
from orderly.models import NodeState
from orderly.worker import nodes
from orderly.worker.runtime import get_runtime

node_app = typer.Typer(
    help="List nodes and move them between RUN, drain and STOPPED.", no_args_is_help=True
)


Note = Annotated[str | None, typer.Option(help="Why: kept with the node's state, and logged")]


def _move(code: str, state: NodeState, note: str | None) -> None:
    call(nodes.set_state, get_runtime().engine, code, state, note=note)
    console.print(f"node {code} is {state.value}")


@node_app.command("run")
def node_run(code: str, note: Note = None) -> None:
    """Accept new messages and process (RUN)."""
    _move(code, NodeState.RUN, note)


@node_app.command("drain")
def node_drain(code: str, note: Note = None) -> None:
    """Refuse new messages, finish existing work (HANDLES_EXISTING_MESSAGES)."""
    _move(code, NodeState.HANDLES_EXISTING_MESSAGES, note)


@node_app.command("stop")
def node_stop(
    code: str,
    exit_: Annotated[
        bool,
        typer.Option(
            "--exit",
            help="Also end the node's worker processes: their service keys are deleted, and "
            "each finishes the tasks in hand and exits.",
        ),
    ] = False,
    note: Note = None,
) -> None:
    """Refuse new messages and process nothing (STOPPED)."""
    _move(code, NodeState.STOPPED, note)
    if exit_:
        stopped = get_runtime().services.stop_node(code)
        ids = ", ".join(str(i) for i in stopped) or "none alive"
        console.print(f"workers of node {code} told to exit: {ids}")


@node_app.command("alive")
def node_alive(
    code: Annotated[
        str | None, typer.Argument(help="Default: this process's ORDERLY_NODE_CODE.")
    ] = None,
) -> None:
    """Exit 0 when the node's processes renewed its heartbeat within
    cluster.nodeHeartbeatTimeoutSec, else 1 (a container's healthcheck)."""
    runtime = get_runtime()
    code = code or runtime.settings.node_code
    timeout = runtime.config.get_int("cluster.nodeHeartbeatTimeoutSec")
    found = [n for n in nodes.list_nodes(runtime.engine, timeout) if n.code == code]
    if not found:
        err.print(f"no node {code!r}")
        raise typer.Exit(code=1)
    if not found[0].alive:
        err.print(f"node {code!r}: no heartbeat since {found[0].last_heartbeat} (> {timeout} s)")
        raise typer.Exit(code=1)
    console.print(f"node {code!r} alive (heartbeat {found[0].last_heartbeat})")


@node_app.command("list")
def node_list(as_json: AsJson = False) -> None:
    runtime = get_runtime()
    timeout = runtime.config.get_int("cluster.nodeHeartbeatTimeoutSec")
    workers: dict[str, list[str]] = {}
    try:
        live = runtime.services.live()
    except Exception as exc:
        err.print(f"[yellow]workers unknown: the tracking Redis could not be read: {exc}[/]")
        live = []
    for service in live:
        code = service.fields.get("node_code", "")
        where = f"{service.service_id} ({service.fields.get('hostname', '')})"
        workers.setdefault(code, []).append(where)
    found = nodes.list_nodes(runtime.engine, timeout)
    if as_json:
        return print_json(
            [
                {
                    "node_id": n.node_id,
                    "code": n.code,
                    "state": n.state.value,
                    "last_heartbeat": n.last_heartbeat,
                    "alive": n.alive,
                    "workers": workers.get(n.code, []),
                }
                for n in found
            ]
        )
    table = Table("id", "code", "state", "last heartbeat", "alive", "workers (service keys)")
    for n in found:
        table.add_row(
            str(n.node_id),
            n.code,
            n.state.value,
            str(n.last_heartbeat or ""),
            "yes" if n.alive else "no",
            ", ".join(workers.get(n.code, [])),
        )
    console.print(table)
