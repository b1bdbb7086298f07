"""``orderly key ...``: API keys. A key's token is printed once, by ``create``."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from orderly.api.cli.common import call, console, err
from orderly.worker import keys
from orderly.worker.runtime import get_runtime

key_app = typer.Typer(help="API keys: create, list, revoke.", no_args_is_help=True)


def _owns(key: dict[str, Any]) -> str:
    owns = key["owns"]
    if owns is None:
        return "every object"
    named = [f"{kind}: {', '.join(map(str, owns[kind]))}" for kind in owns if owns[kind]]
    return "; ".join(named) or "no object"


@key_app.command("create")
def key_create(
    name: str,
    scope: Annotated[
        list[str],
        typer.Option(
            "--scope",
            "-s",
            help=f"Repeat for several: {', '.join(keys.SCOPES)} or publish:<room>.",
        ),
    ],
    expires_at: Annotated[
        str | None, typer.Option(help="ISO 8601, e.g. 2027-01-31T00:00:00Z (default: never)")
    ] = None,
    source_system: Annotated[
        list[str] | None,
        typer.Option(help="Bind the key: a source system whose messages it may act on (repeat)."),
    ] = None,
    origin: Annotated[
        list[str] | None,
        typer.Option(help="Bind the key: an origin whose conversations it may act on (repeat)."),
    ] = None,
    subscription: Annotated[
        list[int] | None,
        typer.Option(help="Bind the key: a subscription id it may pull and operate (repeat)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Create a key; its token is printed this once and cannot be shown again. Without
    --source-system, --origin or --subscription it acts on every object."""
    data: dict[str, object] = {"name": name, "scopes": scope}
    if expires_at is not None:
        data["expires_at"] = expires_at
    if source_system or origin or subscription:
        data["owns"] = {
            "source_systems": source_system or [],
            "origins": origin or [],
            "subscriptions": subscription or [],
        }
    made, token = call(keys.create_key, get_runtime().engine, data)
    if as_json:
        console.print_json(json.dumps({**made, "token": token}))
        return
    err.print(f"key {made['name']!r} with scopes {', '.join(made['scopes'])}, {_owns(made)}")
    err.print("its token, shown this once (send it as Authorization: Bearer <token>):")
    print(token)


@key_app.command("list")
def key_list(
    revoked: Annotated[bool, typer.Option(help="Revoked keys too.")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Keys by name, without their tokens."""
    found = keys.list_keys(get_runtime().engine, revoked=revoked)
    if as_json:
        console.print_json(json.dumps(found))
        return
    table = Table(
        "name", "prefix", "scopes", "acts on", "created", "expires", "revoked", "last used"
    )
    for k in found:
        table.add_row(
            k["name"],
            k["prefix"],
            " ".join(k["scopes"]),
            _owns(k),
            k["created_at"][:19],
            (k["expires_at"] or "")[:19],
            (k["revoked_at"] or "")[:19],
            (k["last_used_at"] or "")[:19],
        )
    console.print(table)


@key_app.command("revoke")
def key_revoke(name: str) -> None:
    """Revoke the live key of that name: its next request is refused."""
    revoked = call(keys.revoke_key, get_runtime().engine, name)
    console.print_json(json.dumps(revoked))
