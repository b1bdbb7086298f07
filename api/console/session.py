"""Signing in to the console with an API key, and what every page and form checks.

Signing in opens a session (worker.sessions): the cookie (HttpOnly, SameSite=Strict, path
/console, Secure over HTTPS) carries its random id, never the key, and is no credential of the
API. Each request finds the session in Redis and its key, live, in PostgreSQL; signing out
ends the session. A script may send the key as ``Authorization: Bearer`` instead. A form
posted with the cookie must carry the session's form token: a page elsewhere can neither read
nor make it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import CONSOLE, Viewer, back_to, page
from orderly.api.http.auth import authenticated
from orderly.api.http.errors import RateLimited, explain
from orderly.api.http.ratelimit import sign_in_limited
from orderly.worker import keys
from orderly.worker.core.errors import Forbidden, OrderlyError, Unauthenticated
from orderly.worker.runtime import Runtime
from orderly.worker.sessions import ConsoleSessions

COOKIE = "orderly_console"
FORM_TOKEN_FIELD = "form_token"
# A console form is a few fields; anything larger is not one.
MAX_FORM_BYTES = 65_536

router = APIRouter(prefix=CONSOLE)


class SignInNeeded(Exception):
    """No valid key or session: the sign-in page (401); ``forget``: a session cookie that no
    longer stands for anything, which the browser is told to drop."""

    def __init__(self, problem: str, *, forget: bool = False) -> None:
        self.problem = problem
        self.forget = forget
        super().__init__(problem)


class Refused(Exception):
    """A signed-in viewer asked for what the key may not do, or sent a bad form."""

    def __init__(self, status: int, problems: list[tuple[str, str]]) -> None:
        self.status = status
        self.problems = problems
        super().__init__("; ".join(p for _, p in problems))


def form_token(token: str) -> str:
    """The form token of a key sent as a bearer token (a session has its own)."""
    return hmac.new(token.encode(), b"orderly console form", hashlib.sha256).hexdigest()


def _token(request: Request) -> tuple[str | None, bool]:
    header = request.headers.get("authorization", "")
    scheme, _, credentials = header.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip(), False
    return request.cookies.get(COOKIE), True


async def _authenticate(request: Request, token: str | None) -> keys.Principal:
    return await authenticated(request, token or "", keys.OPERATE)


def _sessions(request: Request) -> ConsoleSessions:
    runtime: Runtime = request.app.state.runtime
    settings = runtime.settings
    return ConsoleSessions(
        runtime.redis,
        runtime.engine,
        runtime.clock,
        idle_s=settings.console_session_idle_s,
        max_s=settings.console_session_max_s,
    )


async def current_viewer(request: Request) -> Viewer:
    """The signed-in viewer; SignInNeeded without a valid key or session, Refused without
    ``operate``."""
    token, by_cookie = _token(request)
    if not token:
        raise SignInNeeded("")
    try:
        if by_cookie:
            session, key = await run_in_threadpool(_sessions(request).resolve, token)
            key.require(keys.OPERATE)
            mark = session.form_token
        else:
            key = await _authenticate(request, token)
            mark = form_token(token)
    except Unauthenticated as exc:
        raise SignInNeeded(str(exc), forget=by_cookie) from None
    except Forbidden as exc:
        raise Refused(403, [("scope", str(exc))]) from None
    viewer = Viewer(key, mark, by_cookie)
    request.state.console_viewer = viewer  # a refusal's page shows it without asking again
    return viewer


Signed = Annotated[Viewer, Depends(current_viewer)]


@dataclass(frozen=True)
class Form:
    """A posted form's fields."""

    fields: dict[str, list[str]]

    def get(self, name: str, default: str = "") -> str:
        """The field's last value."""
        values = self.fields.get(name)
        return values[-1] if values else default

    def all(self, name: str) -> list[str]:
        """Every non-blank value of a field (ticked boxes)."""
        return [v for v in self.fields.get(name, []) if v.strip()]

    def text(self, name: str) -> str | None:
        """The field's value stripped, None when blank."""
        return self.get(name).strip() or None


def require_unbound(viewer: Viewer) -> None:
    """Pages about the whole system (figures, nodes): not for a key bound to its own objects,
    as ``GET /metrics`` is not (its scope cannot be bound)."""
    if viewer.key.owns is not None:
        problem = f"the key {viewer.key.name!r} acts on its own objects only, not the whole system"
        raise Refused(403, [("owns", problem)])


def require_admin(viewer: Viewer) -> None:
    if not viewer.admin:
        raise Refused(403, [("scope", f"the key {viewer.key.name!r} lacks the scope 'admin'")])


def _same_site(request: Request) -> None:
    """A form must come from a console page: a browser names where a POST came from
    (Sec-Fetch-Site, Origin); one from another site (signing someone in with another key,
    signing them out) is refused. Clients that are not browsers send neither."""
    fetched_from = request.headers.get("sec-fetch-site")
    if fetched_from is not None and fetched_from not in ("same-origin", "none"):
        raise Refused(403, [("origin", f"a form posted from another site ({fetched_from})")])
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host", ""):
        raise Refused(403, [("origin", f"a form posted from {origin}")])


async def form(request: Request, viewer: Viewer | None = None) -> Form:
    """A posted form, from a console page. With ``viewer``: a change, which needs ``admin``
    and, when the viewer came with the session cookie, the session's form token."""
    _same_site(request)
    if request.headers.get("content-type", "").split(";")[0].strip() != (
        "application/x-www-form-urlencoded"
    ):
        raise Refused(415, [("body", "send the console's form (x-www-form-urlencoded)")])
    raw = await request.body()
    if len(raw) > MAX_FORM_BYTES:
        raise Refused(413, [("body", f"a form larger than {MAX_FORM_BYTES} bytes")])
    try:
        parsed = parse_qs(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError:
        raise Refused(400, [("body", "a form that is not UTF-8")]) from None
    fields = Form(parsed)
    if viewer is not None:
        if viewer.by_cookie and not hmac.compare_digest(
            fields.get(FORM_TOKEN_FIELD).encode(), viewer.form_token.encode()
        ):
            raise Refused(403, [(FORM_TOKEN_FIELD, "missing or wrong: reload the page")])
        require_admin(viewer)
    return fields


async def attempt(call: Callable[[], Any]) -> Any:
    """Run a change in a thread; a refusal becomes Refused, with the status and the problems
    the API would answer it with."""
    try:
        return await run_in_threadpool(call)
    except OrderlyError as exc:
        status, problems = explain(exc) or (422, [("input", p) for p in _problems(exc)])
        raise Refused(status, problems) from None


async def act(
    viewer: Viewer, call: Callable[[], Any], back: str, done: str | Callable[[Any], str]
) -> Response:
    """Run a change; then the page ``back`` saying ``done`` (or what ``done`` makes of the
    result), or the refusal."""
    result = await attempt(call)
    return back_to(back, done if isinstance(done, str) else done(result), viewer)


def _problems(exc: OrderlyError) -> list[str]:
    found = getattr(exc, "problems", None)
    return [str(p) for p in found] if found else [str(exc)]


# --- signing in and out -----------------------------------------------------------------------


def _sign_in(request: Request, problem: str = "", status: int = 200) -> HTMLResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="orderly console"'} if status == 401 else None
    return page(request, "login.html", None, status=status, headers=headers, problem=problem)


@router.get("/login")
async def login_page(request: Request) -> HTMLResponse:
    return _sign_in(request)


@router.post("/login")
async def login(request: Request) -> Response:
    token = (await form(request)).get("key").strip()
    # Guesses are throttled per address and per key tried, before any lookup.
    throttled = await sign_in_limited(request, token)
    if throttled is not None:
        slow_down = _sign_in(request, str(throttled), 429)
        slow_down.headers["Retry-After"] = str(throttled.retry_after_s)
        return slow_down
    try:
        key = await _authenticate(request, token)
    except Unauthenticated as exc:
        return _sign_in(request, str(exc), 401)
    except Forbidden as exc:
        return _sign_in(request, str(exc), 403)
    except RateLimited as exc:  # this address's refused keys: over their limit
        slowed = _sign_in(request, str(exc), 429)
        slowed.headers["Retry-After"] = str(exc.retry_after_s)
        return slowed
    opened = functools.partial(
        _sessions(request).open, token, key.name, replacing=request.cookies.get(COOKIE)
    )
    session_id = await run_in_threadpool(opened)
    answer = RedirectResponse("/console/messages", status_code=303)
    answer.set_cookie(
        COOKIE,
        session_id,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/console",
    )
    return answer


@router.post("/logout")
async def logout(request: Request) -> Response:
    await form(request)
    session_id = request.cookies.get(COOKIE)
    if session_id:
        # Ended in Redis, not only dropped by the browser: a copy of the cookie is dead too.
        await run_in_threadpool(_sessions(request).close, session_id)
    answer = RedirectResponse("/console/login", status_code=303)
    answer.delete_cookie(COOKIE, path="/console")
    return answer


@router.get("")
async def home(viewer: Signed) -> Response:
    return RedirectResponse("/console/messages", status_code=303)


# --- what a refusal shows -----------------------------------------------------------------


async def _sign_in_needed(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SignInNeeded)
    answer = _sign_in(request, exc.problem, 401)
    if exc.forget:
        answer.delete_cookie(COOKIE, path="/console")
    return answer


async def _refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refused)
    viewer: Viewer | None = getattr(request.state, "console_viewer", None)
    return page(request, "refused.html", viewer, status=exc.status, problems=exc.problems)


def install(app: FastAPI) -> None:
    app.add_exception_handler(SignInNeeded, _sign_in_needed)
    app.add_exception_handler(Refused, _refused)
