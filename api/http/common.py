"""What every router takes from a request: the app's runtime and intake, and a JSON body."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Depends, Request

from api.http.errors import MalformedBody
from worker.intake import Intake
from worker.runtime import Runtime


async def app_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


async def app_intake(request: Request) -> Intake:
    """The intake the lifespan built (it needs the Celery face, imported at startup)."""
    intake: Intake = request.app.state.intake
    return intake


AppRuntime = Annotated[Runtime, Depends(app_runtime)]
AppIntake = Annotated[Intake, Depends(app_intake)]


async def json_body(request: Request) -> Any:
    # Read by hand, not declared as a body model: worker.* validates and names the fields.
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MalformedBody(f"malformed JSON: {exc}") from None
