"""The API's documented contract: request bodies, the error shape, offline /docs.

The routes read their bodies by hand (worker.* validates them and names every bad field), so
FastAPI cannot infer the bodies; each write route declares its pydantic model here
(:func:`body`) and the OpenAPI document gets the model's schema under that name. Every error
status answers ``{"errors": [{"field", "problem"}]}`` (:class:`Errors`); a route may
describe its 409 its own way (:func:`conflict`). Swagger UI's assets (a release that reads
OpenAPI 3.1) come from the ``fastapi-offline`` package, so /docs works without internet.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

ASSETS = "/docs-assets"
_STATIC = Path(fastapi_offline.__file__).parent / "static"


class Problem(BaseModel):
    field: str
    problem: str


class Errors(BaseModel):
    """Every refusal: each problem names its field (or the service that is unreachable)."""

    errors: list[Problem]


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": Errors, "description": text}
    for status, text in {
        400: "malformed input (the body is not JSON, a NUL in the path)",
        401: "no API key, or one that is unknown, revoked or expired",
        403: "the API key lacks the scope this operation needs (named)",
        404: "no such message, room, subscription, request or ACK id (or not the API key's: "
        "another tenant's object answers as one that does not exist)",
        409: "the message is not in a state that allows this",
        413: "the body is over the size limit",
        422: "invalid input: every bad field named",
        429: "over a rate limit (the client address's, the API key's or its refused "
        "credentials'; with Retry-After)",
        503: "PostgreSQL, Redis or the broker unreachable, or the node takes no new input "
        "(with Retry-After)",
    }.items()
}


def conflict(description: str) -> dict[int | str, dict[str, Any]]:
    """A route's own description of its 409, in place of the generic one (the same shape)."""
    return {409: {"model": Errors, "description": description}}


# /health and /ready take no credential: they never answer 401 or 403; an ACK's credential is
# its token, which has no scopes: never 403.
PUBLIC_ERROR_RESPONSES = {s: r for s, r in ERROR_RESPONSES.items() if s not in (401, 403)}
ACK_ERROR_RESPONSES = {s: r for s, r in ERROR_RESPONSES.items() if s != 403}

_BODIES: dict[str, type[BaseModel]] = {}


def body(name: str, model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model`` (documented as ``name``)."""
    _BODIES[name] = model
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _tag(path_item: dict[str, Any]) -> str:
    for operation in path_item.values():
        if isinstance(operation, dict) and operation.get("tags"):
            return str(operation["tags"][0])
    return ""


def _listed(paths: dict[str, Any], tags: Sequence[str]) -> dict[str, Any]:
    """The paths in the order of their tags in ``tags``; of one tag, in the routes' order."""
    rank = {tag: i for i, tag in enumerate(tags)}
    return dict(sorted(paths.items(), key=lambda item: rank.get(_tag(item[1]), len(rank))))


def install(app: FastAPI, tags: Sequence[str] = ()) -> None:
    """The OpenAPI document with the declared bodies, its paths listed in the order of
    ``tags`` (whatever order the routes are matched in), and /docs served from the package."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, routes=app.routes, tags=app.openapi_tags
            )
            if tags and "paths" in schema:
                schema["paths"] = _listed(schema["paths"], tags)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in _BODIES.items():
                found = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(found.pop("$defs", {}))
                components[name] = found
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.mount(ASSETS, StaticFiles(directory=str(_STATIC)), "docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title="orderly API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png",
        )
