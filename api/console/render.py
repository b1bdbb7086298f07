"""Pages: the Jinja2 templates beside this module, escaped, with the console's headers."""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

from orderly.worker.keys import ADMIN, Principal

HERE = Path(__file__).resolve().parent
# Where the console's pages are: every route of its routers begins with it (so that a
# route's own path is its whole template, as the request metrics count it).
CONSOLE = "/console"
STATIC_DIR = HERE / "static"

# Nothing but the console's own files: no CDN, no inline script, no frame around it.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    # same-origin, not no-referrer: with no-referrer a browser posts forms with "Origin: null"
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class Viewer:
    """Who looks at the console: the key, and the token its forms must carry."""

    key: Principal
    form_token: str
    by_cookie: bool

    @property
    def admin(self) -> bool:
        return self.key.allows(ADMIN)


def _moment(value: Any) -> str:
    """A time to the millisecond, in UTC."""
    if value is None or value == "":
        return ""
    if isinstance(value, datetime):
        moment = value if value.tzinfo is None else value.astimezone(UTC)
        return moment.isoformat(sep=" ", timespec="milliseconds").removesuffix("+00:00")
    return str(value)


def _pretty(value: Any) -> str:
    """A payload as it is, or indented when it is JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            return json.dumps(json.loads(value), indent=2, ensure_ascii=False)
        except ValueError:
            return value
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def _query(request: Request, **changes: Any) -> str:
    """The page's query string with ``changes`` (None or "" drops a parameter)."""
    params = {k: v for k, v in request.query_params.items() if k not in ("done", "sig")}
    for name, value in changes.items():
        if value is None or value == "":
            params.pop(name, None)
        else:
            params[name] = str(value)
    return "?" + urlencode(params) if params else "?"


_env = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters["moment"] = _moment
_env.filters["pretty"] = _pretty


def page(
    request: Request,
    template: str,
    viewer: Viewer | None,
    *,
    status: int = 200,
    headers: dict[str, str] | None = None,
    **context: Any,
) -> HTMLResponse:
    """``template`` rendered for ``viewer`` (None: not signed in)."""
    body = _env.get_template(template).render(
        request=request,
        viewer=viewer,
        done=_done(request, viewer),
        query=lambda **changes: _query(request, **changes),
        **context,
    )
    return HTMLResponse(body, status_code=status, headers={**HEADERS, **(headers or {})})


def _signed(viewer: Viewer, done: str) -> str:
    mac = hmac.new(viewer.form_token.encode(), done.encode(), hashlib.sha256)
    return mac.hexdigest()[:32]


def _done(request: Request, viewer: Viewer | None) -> str:
    """What the last change did: shown only when this viewer's change said so (a link with
    any other text in ``done`` shows nothing)."""
    done = request.query_params.get("done", "")
    sig = request.query_params.get("sig", "")
    if not done or viewer is None:
        return ""
    return done if hmac.compare_digest(sig.encode(), _signed(viewer, done).encode()) else ""


def back_to(url: str, done: str, viewer: Viewer) -> RedirectResponse:
    """After a change: the page to show (POST, redirect, GET), saying what was done."""
    path, hash_, fragment = url.partition("#")
    sep = "&" if "?" in path else "?"
    query = urlencode({"done": done, "sig": _signed(viewer, done)})
    return RedirectResponse(f"{path}{sep}{query}{hash_}{fragment}", status_code=303)
