"""``orderly conversation ...``: register requests, add responses, ACK them, inspect; the
operators' operations (get, delete, awaited, awaited-date, remove-at)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated, Any

import typer

from orderly.api.cli.common import call, console, parse_payload, show_result
from orderly.worker.runtime import get_runtime

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
    corr: Annotated[str | None, typer.Option(help="The request's correlator")] = None,
) -> None:
    """Register a user's request (POST /conversations/{id}/requests)."""
    data: dict[str, Any] = {"request_id": request_id, "origin": origin}
    if corr is not None:
        data["corr"] = corr
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
    corr: Annotated[str | None, typer.Option(help="The response's correlator")] = None,
) -> None:
    """Add a response to deliver in order (POST /conversations/{id}/responses)."""
    data: dict[str, Any] = {
        "request_id": request_id,
        "response_id": response_id,
        "payload": parse_payload(payload),
        "last": last,
    }
    if corr is not None:
        data["corr"] = corr
    if timestamp is not None:
        data["timestamp"] = timestamp
    runtime = get_runtime()
    result = call(
        runtime.conversations.add_response, conversation_id, data, runtime.broker.enqueue_drain
    )
    show_result(
        result.msg_id, result.state.value, "accepted" if result.created else "already known"
    )


@conversation_app.command("ack")
def conversation_ack(async_response_id: str) -> None:
    """ACK a response the client answered with 202 (POST /acks/{id})."""
    runtime = get_runtime()
    msg_id = call(runtime.conversations.ack, async_response_id, runtime.broker.enqueue_drain)
    console.print_json(json.dumps({"msg_id": msg_id, "state": "OK"}))


@conversation_app.command("show")
def conversation_show(conversation_id: str) -> None:
    """What Redis holds for a conversation: requests and responses in delivery order."""
    console.print_json(json.dumps(get_runtime().conversations.describe(conversation_id)))


@conversation_app.command("get")
def conversation_get(
    response_id: Annotated[str | None, typer.Option(help="The response's id")] = None,
    async_response_id: Annotated[
        str | None, typer.Option(help="The id the client's 202 gave (its ACK id)")
    ] = None,
    fields: Annotated[str | None, typer.Option(help="Only these fields, comma-separated")] = None,
) -> None:
    """One response by its id or its ACK id (GET /conversation-messages)."""
    view = call(
        get_runtime().conversations.get_message,
        response_id=response_id,
        async_response_id=async_response_id,
        fields=fields,
    )
    console.print_json(json.dumps(view))


@conversation_app.command("delete")
def conversation_delete(
    conversation_id: str,
    request_id: Annotated[str, typer.Option(help="The request whose messages go")],
    status: Annotated[
        str | None, typer.Option(help="Only responses in it: PENDING, AWAITED or SENT")
    ] = None,
    all_origin_except: Annotated[
        str | None, typer.Option(help="Nothing goes when the request's origin is this one")
    ] = None,
    note: Annotated[str | None, typer.Option(help="Why (stored on the rows)")] = None,
    by: Annotated[str, typer.Option(help="Who")] = "operator",
) -> None:
    """Delete a request's messages (DELETE /conversations/{id}/requests/{request_id})."""
    given = {"status": status, "all_origin_except": all_origin_except, "note": note, "by": by}
    data = {name: value for name, value in given.items() if value is not None}
    runtime = get_runtime()
    done = call(
        runtime.conversations.delete_register,
        conversation_id,
        request_id,
        data,
        runtime.broker.enqueue_drain,
    )
    console.print_json(json.dumps(asdict(done)))


@conversation_app.command("awaited")
def conversation_awaited(
    conversation_id: str,
    request_id: Annotated[str | None, typer.Option(help="Every response of this request")] = None,
    response_id: Annotated[str | None, typer.Option(help="This response")] = None,
    note: Annotated[str | None, typer.Option(help="Why (stored on the rows)")] = None,
    by: Annotated[str, typer.Option(help="Who")] = "operator",
) -> None:
    """Set responses AWAITED by hand (POST .../requests|responses/{id}/awaited)."""
    data = {"by": by, **({"note": note} if note is not None else {})}
    done = call(
        get_runtime().conversations.set_awaited,
        conversation_id,
        data,
        request_id=request_id,
        response_id=response_id,
    )
    console.print_json(json.dumps(asdict(done)))


@conversation_app.command("awaited-date")
def conversation_awaited_date(
    conversation_id: str,
    response_id: Annotated[str, typer.Option(help="An AWAITED response")],
    at: Annotated[str, typer.Option(help="ISO 8601: when the awaited agent takes it up")],
    note: Annotated[str | None, typer.Option(help="Why (stored on the row)")] = None,
    by: Annotated[str, typer.Option(help="Who")] = "operator",
) -> None:
    """A new awaited date (PUT /conversations/{id}/responses/{response_id}/awaited-date)."""
    data = {"awaited_to_date": at, "by": by, **({"note": note} if note is not None else {})}
    done = call(get_runtime().conversations.set_awaited_date, conversation_id, response_id, data)
    console.print_json(json.dumps(done))


@conversation_app.command("remove-at")
def conversation_remove_at(
    conversation_id: str,
    response_id: Annotated[str, typer.Option(help="The response whose references go")],
    delay: Annotated[int, typer.Option(help="Seconds from now")],
    note: Annotated[str | None, typer.Option(help="Why (stored on the row)")] = None,
    by: Annotated[str, typer.Option(help="Who")] = "operator",
) -> None:
    """Remove a response's references from Redis after a delay (POST .../removal)."""
    data = {"delay_s": delay, "by": by, **({"note": note} if note is not None else {})}
    done = call(get_runtime().conversations.remove_at, conversation_id, response_id, data)
    console.print_json(json.dumps(done))
