"""orderly's app with one route that fails unexpectedly, for the API's 500 (``uvicorn
tests.buggy_app:create_app --factory``)."""

from __future__ import annotations

from fastapi import FastAPI

import orderly.api.http


def create_app() -> FastAPI:
    app = orderly.api.http.create_app()

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("a bug")

    return app
