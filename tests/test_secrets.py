"""No secret (the database password, the token secret, Flower's password, API keys, ACK
secrets) shows in the logs of the API, a worker and beat, in `orderly status`, or in any
answer of the API, errors included."""

from __future__ import annotations

import json

from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from tests.conftest import TEST_DB_URL
from tests.helpers import OrderlyCli, message
from tests.stack import Stack

# PostgreSQL here trusts local connections: the password is carried everywhere, never checked.
SECRETS = {
    "ORDERLY_TOKEN_SECRET": "token-secret-5b7a9d3e2f4c1a0b",
    "ORDERLY_FLOWER_PASSWORD": "flower-pw-61e2c7d94a",
}
DB_PASSWORD = "db-pw-8c1f0e3a77"


def test_no_secret_in_logs_status_or_answers(stack: Stack, db: Engine, cli: OrderlyCli) -> None:
    url = make_url(TEST_DB_URL).set(password=DB_PASSWORD).render_as_string(hide_password=False)
    env = {"ORDERLY_DATABASE_URL": url, **SECRETS}
    stack.env(**env)
    stack.start_api()
    stack.worker()
    stack.beat()
    http = stack.http
    answers = []
    http.put("/channels/chat", json={"url": "http://127.0.0.1:9/"}).raise_for_status()
    msg_id = stack.submit(message(1))
    stack.wait_state(msg_id, "OK")
    answers.append(http.post("/rooms", json={"name": "r"}).text)
    answers.append(http.post("/rooms/r/events", json={"routing_key": "a", "payload": {}}).text)
    answers.append(http.post("/messages", json={"service": 1}).text)  # 422
    answers.append(http.post("/messages", content=b"{").text)  # 400
    answers.append(http.get("/messages/999999").text)  # 404
    answers.append(http.get("/ready").text)
    answers.append(http.get("/metrics").text)
    answers.append(json.dumps(http.get("/openapi.json").json()))
    answers.append(http.get("/keys?revoked=true").text)
    answers.append(http.get("/channels").text)
    answers.append(http.get("/messages", headers={"Authorization": "Bearer orderly_x_y"}).text)
    with db.connect() as conn:
        ack_secrets = conn.execute(text("SELECT secret FROM channel_ack_secret")).scalars().all()
    status = cli("status", env=env)
    assert status.returncode == 0, status.stderr
    texts = {
        "answers": "\n".join(answers),
        "orderly status": status.stdout + status.stderr,
        **{m.name: m.log_path.read_text(errors="replace") for m in stack.procs.procs},
    }
    for where, seen in texts.items():
        assert seen.strip(), f"nothing to look at in {where}"
        for secret in (DB_PASSWORD, *SECRETS.values(), stack.token, *ack_secrets):
            assert secret not in seen, f"{secret!r} shows in {where}"
