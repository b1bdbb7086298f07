"""``orderly signing-secret ...``: the secrets outbound requests are signed with (worker.signing;
Standard Webhooks signatures). A destination is a kind and a name: ``channel ORIGIN``,
``subscription ID``, ``source_system NAME``. Talks to PostgreSQL directly (an operator's
tool, like ``orderly key``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from orderly.api.cli.common import AsJson, call, console
from orderly.models import SIGNING_KINDS
from orderly.worker.runtime import get_runtime
from orderly.worker.signing import KEEP_PREVIOUS_S, Secrets

signing_app = typer.Typer(
    help="Signing secrets: what receivers verify orderly's requests with.",
    no_args_is_help=True,
)

Kind = Annotated[str, typer.Argument(help=f"One of {', '.join(SIGNING_KINDS)}")]
Name = Annotated[
    str, typer.Argument(help="The channel's origin, the subscription's id, the source system")
]


def _show(found: Secrets, as_json: bool) -> None:
    view = found.view()
    if as_json:
        console.print_json(json.dumps(view))
        return
    console.print(f"{found.kind} {found.name}: {found.secret}", highlight=False, soft_wrap=True)
    if found.previous is not None:
        console.print(
            f"  also signed with the previous secret until {view['previous_until']}: "
            f"{found.previous}",
            highlight=False,
            soft_wrap=True,
        )


@signing_app.command("show")
def signing_show(kind: Kind, name: Name, as_json: AsJson = False) -> None:
    """A destination's secret (made now if no request went there yet): give it to the
    receiver, whose verify checks orderly's requests with it."""
    _show(call(get_runtime().signing.get, kind, name), as_json)


@signing_app.command("rotate")
def signing_rotate(
    kind: Kind,
    name: Name,
    keep_previous_s: Annotated[
        int,
        typer.Option(
            "--keep-previous-s",
            help="How long requests are still signed with the previous secret too (0: no longer)",
        ),
    ] = KEEP_PREVIOUS_S,
    as_json: AsJson = False,
) -> None:
    """A new secret for a destination; requests carry both signatures while the previous one
    is kept, so the receiver can switch without losing one."""
    _show(call(get_runtime().signing.rotate, kind, name, keep_previous_s), as_json)
