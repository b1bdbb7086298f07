"""The ``orderly`` command line: the root app and one module per noun. Thin: every rule
lives in worker.*."""

from __future__ import annotations

from typing import Annotated

import typer

from orderly.api.cli import (
    channels,
    config,
    conversations,
    dead_letters,
    funnel_limits,
    keys,
    messages,
    migrate,
    nodes,
    pubsub_logs,
    purge,
    rebuild,
    report,
    rooms,
    runners,
    schedules,
    settings,
    signing,
    sources,
    status,
    subscriptions,
    tracking,
)
from orderly.api.cli.common import run

__all__ = ["app", "main"]

app = typer.Typer(
    help="orderly: ordered delivery over Celery, Redis and PostgreSQL.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"orderly {version('orderly')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """orderly: ordered delivery over Celery, Redis and PostgreSQL."""


# Registered here, in this order: it is the order ``orderly --help`` lists them in.
app.command()(runners.up)
app.command()(runners.api)
app.command()(runners.worker)
app.command()(runners.beat)
app.command()(runners.flower)
app.command()(migrate.migrate)
app.command()(settings.settings)
app.command()(messages.submit)
app.command()(messages.show)
app.command()(status.status)
app.command()(report.report)
app.command()(rooms.publish)
app.command()(rebuild.rebuild)
app.command()(purge.purge)
app.add_typer(messages.message_app, name="message")
app.add_typer(sources.source_app, name="source")
app.add_typer(rooms.room_app, name="room")
app.add_typer(subscriptions.subscription_app, name="subscription")
app.add_typer(dead_letters.dead_app, name="dead-letter")
app.add_typer(pubsub_logs.log_app, name="log")
app.add_typer(conversations.conversation_app, name="conversation")
app.add_typer(channels.channel_app, name="channel")
app.add_typer(config.config_app, name="config")
app.add_typer(nodes.node_app, name="node")
app.add_typer(keys.key_app, name="key")
app.add_typer(schedules.schedule_app, name="schedule")
app.add_typer(funnel_limits.funnel_limit_app, name="funnel-limit")
app.add_typer(signing.signing_app, name="signing-secret")
app.add_typer(tracking.track_app, name="track")


def main() -> None:
    run(app)
