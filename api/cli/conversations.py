"""``orderly conversation ...``: register requests, add responses, ACK them, inspect."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from api.cli.common import call, console, parse_payload, show_result
from worker.runtime import get_runtime

conversation_app = typer.Typer(
    help="Conversations: register requests, add responses, ACK, inspect.", no_args_is_help=True
)


@conversation_app.command("request")
def conversation_request(
    conversation_id: str,
    request_id: Annotated[str, typer.Option(help="The request's unique id")],
    origin: Annotated[str, typer.Option(help="The client channel, e.g. whatsapp")],
    payload: Annotated[str | None, typer.Option(help="JSON or text")] = None,
    timestamp: Annotated[str | None, typer.Option(help="ISO 8601; default now")] = None,
) -> None:
    """Register a user's request (POST /conversations/{id}/requests)."""
    data: dict[str, Any] = {"request_id": request_id, "origin": origin}
    if payload is not None:
        data["payload"] = parse_payload(payload)
    if timestamp is not None:
        data["timestamp"] = timestamp
    result = call(get_runtime().conversations.register_request, conversation_id, data)
    show_result(
        result.msg_id, result.state.value, "registered" if result.created else "already known"
    )


@conversation_app.command("respond")
def conversation_respond(
    conversation_id: str,
    request_id: Annotated[str, typer.Option(help="The request answered")],
    response_id: Annotated[str, typer.Option(help="The response's unique id")],
    payload: Annotated[str, typer.Option(help="JSON or text")],
    last: Annotated[bool, typer.Option(help="The request's final response")] = False,
    timestamp: Annotated[str | None, typer.Option(help="ISO 8601; default now")] = None,
) -> None:
    """Add a response to deliver in order (POST /conversations/{id}/responses)."""
    from worker.celery import enqueue_drain

    data: dict[str, Any] = {
        "request_id": request_id,
        "response_id": response_id,
        "payload": parse_payload(payload),
        "last": last,
    }
    if timestamp is not None:
        data["timestamp"] = timestamp
    result = call(get_runtime().conversations.add_response, conversation_id, data, enqueue_drain)
    show_result(
        result.msg_id, result.state.value, "accepted" if result.created else "already known"
    )


@conversation_app.command("ack")
def conversation_ack(async_response_id: str) -> None:
    """ACK a response the client answered with 202 (POST /acks/{id})."""
    from worker.celery import enqueue_drain

    msg_id = call(get_runtime().conversations.ack, async_response_id, enqueue_drain)
    console.print_json(json.dumps({"msg_id": msg_id, "state": "OK"}))


@conversation_app.command("show")
def conversation_show(conversation_id: str) -> None:
    """What Redis holds for a conversation: requests and responses in delivery order."""
    console.print_json(json.dumps(get_runtime().conversations.describe(conversation_id)))
