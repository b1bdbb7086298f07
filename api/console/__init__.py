"""The operator console: server-rendered pages under ``/console``, behind the API keys.

A key with ``operate`` sees every page; changes (cancel, re-drive, respond, dead letters,
configuration, keys) also need ``admin``, and the keys page needs it to be seen. Signing in
with a key opens a session: its cookie (HttpOnly, SameSite=Strict, path /console) holds a
random session id, not the key (session.py, worker.sessions); a script may send the key in an
``Authorization: Bearer`` header instead. Every form carries the session's form token, so a
page of another site cannot post one. Every value is escaped by the templates (Jinja2 autoescape)
and the pages load nothing but ``/console/static`` (a Content-Security-Policy says so): it
works with no network access. Thin: the data and the changes are worker.*'s.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from orderly.api.console import (
    conversations,
    figures,
    funnel_limits,
    keys,
    messages,
    nodes,
    rooms,
    schedules,
    session,
)
from orderly.api.console.render import STATIC_DIR

__all__ = ["install"]


def install(app: FastAPI) -> None:
    """Mount the console's pages and its static files on ``app`` (not in /openapi.json)."""
    session.install(app)
    for module in (
        session,
        messages,
        conversations,
        rooms,
        schedules,
        funnel_limits,
        nodes,
        keys,
        figures,
    ):
        app.include_router(module.router, include_in_schema=False)  # paths under CONSOLE
    app.mount("/console/static", StaticFiles(directory=STATIC_DIR), name="console-static")
