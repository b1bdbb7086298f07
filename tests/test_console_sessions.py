"""Console sessions against the real Redis and PostgreSQL, on a clock the test moves: the cookie
a sign-in sets is a session id (not the key, and refused by the API), its pages and forms work
with the session's form token, signing out and revoking the key end it, it ends after its idle
timeout and its absolute lifetime (ORDERLY_CONSOLE_SESSION_*), and a forged one is refused
without asking PostgreSQL."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event

from orderly.api.console.session import COOKIE, form_token
from orderly.models.keys import console_session
from orderly.worker import keys
from orderly.worker.runtime import Runtime, get_runtime
from orderly.worker.settings import Settings, get_settings
from tests.helpers import ManualClock, api_key

# Other than the defaults, so that the tests see the settings read.
IDLE_S = 600
MAX_S = 3600


@dataclass
class Console:
    http: TestClient
    clock: ManualClock
    redis: redis.Redis
    runtime: Runtime

    def sign_in(self, token: str) -> str:
        """Sign in with ``token``: the session id the cookie got."""
        answer = self.http.post("/console/login", data={"key": token}, follow_redirects=False)
        assert answer.status_code == 303, answer.text
        session_id = str(answer.cookies[COOKIE])
        assert session_id
        # Each request names its session itself: the client keeps none between them.
        self.http.cookies.clear()
        return session_id

    def page(self, path: str, session_id: str) -> Any:
        return self.http.get(path, headers=cookie(session_id), follow_redirects=False)

    def stored(self, session_id: str) -> bytes | None:
        found = self.redis.get(redis_key(session_id))
        assert found is None or isinstance(found, bytes)
        return found


def redis_key(session_id: str) -> str:
    """Where Redis keeps the session of that id (by its SHA-256)."""
    return console_session(hashlib.sha256(session_id.encode()).hexdigest())


def cookie(session_id: str) -> dict[str, str]:
    return {"Cookie": f"{COOKIE}={session_id}"}


@pytest.fixture
def console(
    db: Engine, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Console]:
    """The API in this process with the console's session limits set, on a manual clock; no
    credential of its own (the ``client`` fixture sends a bearer key)."""
    monkeypatch.setenv("ORDERLY_CONSOLE_SESSION_IDLE_S", str(IDLE_S))
    monkeypatch.setenv("ORDERLY_CONSOLE_SESSION_MAX_S", str(MAX_S))
    get_settings.cache_clear()
    get_runtime.cache_clear()
    from orderly.api.http import create_app

    app = create_app()
    clock = ManualClock()
    monkeypatch.setattr(app.state.runtime, "clock", clock)
    with TestClient(app) as http:
        yield Console(http, clock, redis_client, app.state.runtime)
    get_settings.cache_clear()
    get_runtime.cache_clear()


def _form_token(html: str) -> str:
    found = re.search(r'name="form_token" value="([^"]+)"', html)
    assert found, "no form token on the page"
    return found.group(1)


def test_the_session_settings_default_to_half_an_hour_idle_and_twelve_hours() -> None:
    fields = Settings.model_fields
    assert fields["console_session_idle_s"].default == 1800
    assert fields["console_session_max_s"].default == 43200


def test_the_cookie_is_a_session_id_not_the_key_and_the_api_refuses_it(
    console: Console, db: Engine
) -> None:
    token = api_key(db, keys.OPERATE, name="ops")
    answer = console.http.post("/console/login", data={"key": token}, follow_redirects=False)
    assert answer.status_code == 303
    set_cookie = answer.headers["set-cookie"]
    session_id = answer.cookies[COOKIE]
    console.http.cookies.clear()
    assert token not in set_cookie and session_id != token
    assert not session_id.startswith("orderly_")
    assert "httponly" in set_cookie.lower() and "samesite=strict" in set_cookie.lower()
    assert "path=/console" in set_cookie.lower()
    # Redis keeps it under the SHA-256 of the id, holding neither the id nor the key.
    held = console.stored(session_id)
    assert held is not None and b"ops" in held
    assert session_id.encode() not in held and token.encode() not in held
    assert not console.redis.keys(f"*{session_id}*")
    assert 0 < int(console.redis.pttl(redis_key(session_id))) <= IDLE_S * 1000
    # The session serves the console ...
    shown = console.page("/console/messages", session_id)
    assert shown.status_code == 200 and "<strong>ops</strong>" in shown.text
    # ... and is no credential of the API, where the key itself is one.
    for path in ("/messages", "/keys"):
        refused = console.http.get(path, headers={"Authorization": f"Bearer {session_id}"})
        assert refused.status_code == 401, path
    assert console.http.get("/messages", headers={"Authorization": f"Bearer {token}"}).is_success
    # Nor does the key work as the cookie: a cookie is a session id or nothing.
    assert console.page("/console/messages", token).status_code == 401


def test_pages_and_forms_work_with_the_sessions_own_form_token(
    console: Console, db: Engine
) -> None:
    token = api_key(db, keys.OPERATE, keys.ADMIN, name="boss")
    api_key(db, keys.METRICS, name="victim")
    api_key(db, keys.METRICS, name="bystander")
    first, second = console.sign_in(token), console.sign_in(token)
    assert first != second
    first_token = _form_token(console.page("/console/keys", first).text)
    second_token = _form_token(console.page("/console/keys", second).text)
    # Each session its own token, derived from nothing a page elsewhere could know.
    assert first_token != second_token and first_token != form_token(token)
    assert first_token == _form_token(console.page("/console/keys", first).text)

    def revoke(name: str, session_id: str, mark: str | None) -> Any:
        data = {"note": ""} if mark is None else {"form_token": mark}
        return console.http.post(
            f"/console/keys/{name}/revoke",
            data=data,
            headers=cookie(session_id),
            follow_redirects=False,
        )

    for mark in (None, "guessed", second_token, form_token(token)):
        refused = revoke("victim", first, mark)
        assert refused.status_code == 403 and "form_token" in refused.text, mark
    live = {k["name"] for k in keys.list_keys(db)}
    assert {"victim", "bystander"} <= live
    done = revoke("victim", first, first_token)
    assert done.status_code == 303 and "key+victim+revoked" in done.headers["location"]
    assert "victim" not in {k["name"] for k in keys.list_keys(db)}
    # The page after the change says so to this session only.
    assert "key victim revoked" in console.page(done.headers["location"], first).text
    assert "key victim revoked" not in console.page(done.headers["location"], second).text
    # A script's bearer key still signs its requests, without a form token.
    scripted = console.http.post(
        "/console/keys/bystander/revoke",
        data={"x": "1"},
        headers={"Authorization": f"Bearer {token}"},
        follow_redirects=False,
    )
    assert scripted.status_code == 303


def test_signing_out_ends_the_session_and_a_replayed_cookie_gets_the_sign_in_page(
    console: Console, db: Engine
) -> None:
    token = api_key(db, keys.OPERATE, name="ops")
    session_id = console.sign_in(token)
    other = console.sign_in(token)
    assert console.page("/console/messages", session_id).status_code == 200
    out = console.http.post(
        "/console/logout", data={"x": "1"}, headers=cookie(session_id), follow_redirects=False
    )
    assert out.status_code == 303 and out.headers["location"] == "/console/login"
    assert console.stored(session_id) is None
    replayed = console.page("/console/messages", session_id)
    assert replayed.status_code == 401 and 'name="key"' in replayed.text
    assert "sign in again" in replayed.text
    # The browser is told to drop the dead cookie.
    assert f'{COOKIE}=""' in replayed.headers["set-cookie"]
    # Another session of the same key lives on.
    assert console.page("/console/messages", other).status_code == 200


def test_signing_in_again_ends_the_browsers_previous_session(console: Console, db: Engine) -> None:
    token = api_key(db, keys.OPERATE, name="ops")
    before = console.sign_in(token)
    answer = console.http.post(
        "/console/login", data={"key": token}, headers=cookie(before), follow_redirects=False
    )
    assert answer.status_code == 303 and answer.cookies[COOKIE] != before
    assert console.stored(before) is None
    assert console.page("/console/messages", before).status_code == 401


def test_revoking_or_expiring_the_key_ends_its_sessions_at_their_next_request(
    console: Console, db: Engine
) -> None:
    token = api_key(db, keys.OPERATE, name="ops")
    sessions = [console.sign_in(token) for _ in range(2)]
    for session_id in sessions:
        assert console.page("/console/messages", session_id).status_code == 200
    # Revoked by another process (orderly key revoke): no key cache stands between.
    keys.revoke_key(db, "ops")
    for session_id in sessions:
        refused = console.page("/console/messages", session_id)
        assert refused.status_code == 401 and "was revoked" in refused.text
        assert console.stored(session_id) is None
    # A key that expires: its session ends at the expiry, on the clock the app reads.
    expires = datetime.now(UTC) + timedelta(minutes=5)
    _, brief = keys.create_key(
        db, {"name": "brief", "scopes": [keys.OPERATE], "expires_at": expires}
    )
    session_id = console.sign_in(brief)
    assert console.page("/console/messages", session_id).status_code == 200
    console.clock.now = expires.timestamp()
    expired = console.page("/console/messages", session_id)
    assert expired.status_code == 401 and "expired" in expired.text
    assert console.stored(session_id) is None


def test_a_session_ends_after_its_idle_timeout(console: Console, db: Engine) -> None:
    token = api_key(db, keys.OPERATE, name="ops")
    session_id = console.sign_in(token)
    # Each use starts the idle time again.
    for _ in range(3):
        console.clock.advance(IDLE_S - 1)
        assert console.page("/console/messages", session_id).status_code == 200
    console.clock.advance(IDLE_S)
    idle = console.page("/console/messages", session_id)
    assert idle.status_code == 401 and f"after {IDLE_S} s without use" in idle.text
    assert console.stored(session_id) is None
    # Gone for good: the clock moved back does not bring it back.
    console.clock.advance(-IDLE_S)
    assert console.page("/console/messages", session_id).status_code == 401


def test_a_session_ends_at_its_absolute_lifetime_however_busy(console: Console, db: Engine) -> None:
    token = api_key(db, keys.OPERATE, name="ops")
    session_id = console.sign_in(token)
    step = IDLE_S // 2
    for _ in range(MAX_S // step - 1):
        console.clock.advance(step)
        assert console.page("/console/messages", session_id).status_code == 200
    # Near its end Redis keeps it no longer than what is left of its lifetime.
    assert 0 < int(console.redis.pttl(redis_key(session_id))) <= step * 1000
    console.clock.advance(step)
    over = console.page("/console/messages", session_id)
    assert over.status_code == 401 and f"{MAX_S} s after signing in" in over.text
    assert console.stored(session_id) is None


def test_a_forged_session_id_is_refused_by_redis_alone(console: Console, db: Engine) -> None:
    token = api_key(db, keys.OPERATE, name="ops")
    real = console.sign_in(token)
    engine = console.runtime.engine
    statements: list[str] = []

    def counted(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", counted)
    try:
        for forged in ("x" * 43, real[:-1] + ("A" if real[-1] != "A" else "B"), "", "y" * 5000):
            refused = console.page("/console/messages", forged)
            assert refused.status_code == 401 and 'name="key"' in refused.text, forged
        # (the API's own node heartbeat and its metrics' writes may run meanwhile: no
        # request's statement)
        background = ("last_heartbeat", "metric_total")
        assert [s for s in statements if not any(b in s for b in background)] == []
        # A real session costs its key's lookup, and the page's own queries.
        assert console.page("/console/messages", real).status_code == 200
        assert any("FROM api_key WHERE prefix" in s for s in statements)
    finally:
        event.remove(engine, "before_cursor_execute", counted)
