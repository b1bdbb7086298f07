"""``orderly funnel-limit ...``: how many messages of one funnel value a funnel component runs
at once (worker.messages.limits). A component is named as in the API's paths: ``-`` for
funnels without a component."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from orderly.api.cli.common import AsJson, call, console, print_json
from orderly.worker.core.cron import iso
from orderly.worker.messages import limits
from orderly.worker.runtime import get_runtime

funnel_limit_app = typer.Typer(
    help="Funnel limits: how many messages of one funnel value a component runs at once.",
    no_args_is_help=True,
)

Component = Annotated[
    str, typer.Argument(help="The funnel component; '-' for funnels without a component")
]


def _named(component_id: str) -> str:
    if component_id == limits.NO_COMPONENT:
        return "funnels without a component"
    return f"component {component_id!r}"


@funnel_limit_app.command("list")
def funnel_limit_list(as_json: AsJson = False) -> None:
    """Every limit; a component not listed runs one message of a funnel value at a time."""
    found = call(limits.list_limits, get_runtime().engine)
    if as_json:
        return print_json([f.as_dict() for f in found])
    table = Table("component", "max in flight", "starts/s (burst)", "updated (UTC)")
    for f in found:
        shown = limits.to_word(f.component_id)
        if f.component_id == limits.NO_COMPONENT:
            shown += " (no component)"
        rate = "-" if f.rate_per_s is None else f"{f.rate_per_s:g} ({f.burst})"
        table.add_row(shown, str(f.max_in_flight), rate, iso(f.updated_at))
    console.print(table)


@funnel_limit_app.command("show")
def funnel_limit_show(component: Component, as_json: AsJson = False) -> None:
    """One component's limit (exits 2 when it has none: one at a time)."""
    found = call(limits.get_limit, get_runtime().engine, limits.from_word(component))
    if as_json:
        return print_json(found.as_dict())
    console.print(
        f"{_named(found.component_id)}: up to {found.max_in_flight} messages of one funnel "
        f"value at once (set {iso(found.updated_at)})",
        highlight=False,
    )


@funnel_limit_app.command("set")
def funnel_limit_set(
    component: Component,
    max_in_flight: Annotated[int, typer.Argument(help="1 to 10000")],
    rate: Annotated[
        float | None,
        typer.Option("--rate", help="at most this many of one funnel value start a second"),
    ] = None,
    burst: Annotated[
        int | None, typer.Option("--burst", help="the rate's bucket (default: the rate)")
    ] = None,
) -> None:
    """Make or replace a component's limit; it holds from the next claim on."""
    runtime = get_runtime()
    key = limits.from_word(component)
    data: dict[str, object] = {"max_in_flight": max_in_flight}
    if rate is not None:
        data["rate_per_s"] = rate
    if burst is not None:
        data["burst"] = burst
    done = call(limits.set_limit, runtime.engine, key, data, runtime.clock)
    verb = "set" if done.created else "changed"
    shown = done.limit
    starts = f", {shown.rate_per_s:g} starts a second" if shown.rate_per_s is not None else ""
    console.print(
        f"{_named(key)}: limit {verb} to {shown.max_in_flight} messages at once{starts}",
        highlight=False,
    )


@funnel_limit_app.command("remove")
def funnel_limit_remove(component: Component) -> None:
    """Remove a component's limit: its funnels run one message at a time again."""
    key = limits.from_word(component)
    call(limits.remove_limit, get_runtime().engine, key)
    console.print(f"{_named(key)}: limit removed, one message at a time", highlight=False)
