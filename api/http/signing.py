"""HTTP face of signing secrets: what a receiver verifies orderly's requests with. A key
bound to its objects sees and rotates only its own destinations' (its channels by origin, its
PULL/PUSH subscriptions by id, its source systems); another's answers 404."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import Operator
from orderly.api.http.common import AppRuntime, json_body
from orderly.api.http.contract import body
from orderly.worker.signing import RotateIn

router = APIRouter()


@router.get("/signing-secrets/{kind}/{name}", responses=answers(a.SigningSecret))
async def show_signing_secret(
    runtime: AppRuntime, kind: str, name: str, key: Operator
) -> JSONResponse:
    """A destination's secret (made now if no request went there yet), and the previous one
    while a rotation lets it sign too."""
    found = await run_in_threadpool(runtime.signing.show_for, kind, name, key.owns)
    return JSONResponse(found.view())


@router.post(
    "/signing-secrets/{kind}/{name}/rotate",
    responses=answers(a.SigningSecret),
    openapi_extra=body("RotateIn", RotateIn),
)
async def rotate_signing_secret(
    runtime: AppRuntime, kind: str, name: str, request: Request, key: Operator
) -> JSONResponse:
    """A new secret for the destination; the one before still signs for ``keep_previous_s``
    (a day by default) so that its receiver can switch without losing a request."""
    data = await json_body(request)
    call = functools.partial(runtime.signing.rotate_for, kind, name, data, key.owns)
    return JSONResponse((await run_in_threadpool(call)).view())
