"""orderly's processes for an end-to-end test: the API on a free port, workers and beat, with an
HTTP client to the API and the calls the tests share. The ``stack`` fixture gives one; the
``procs`` group under it stops every process after the test and shows their logs if it
failed."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Mapping
from typing import Any

import httpx
from sqlalchemy import Engine

from tests.helpers import api_key, wait_until
from tooling.processes import Managed, ProcessGroup, free_port, wait_for_log

# Starting a Celery process imports the whole app: on a loaded machine that takes a while.
START_TIMEOUT_S = 60.0


class Stack:
    """Processes a test starts as it needs them, in the order it needs them."""

    def __init__(self, procs: ProcessGroup, db: Engine) -> None:
        self.procs = procs
        self.db = db
        self.port = 0
        self._http: httpx.Client | None = None
        # An API key with every scope, made when the API first starts.
        self.token = ""

    def env(self, **values: str) -> None:
        """Settings for every process started from now on."""
        self.procs.env.update(values)

    # --- processes ------------------------------------------------------------------------

    def start_api(
        self, *, node: str | None = "api-node", handler_modules: str | None = None
    ) -> Managed:
        """The API on a free port, answering /health; ``node`` None keeps the run's node."""
        env: dict[str, str] = {}
        if node is not None:
            env["ORDERLY_NODE_CODE"] = node
        if handler_modules is not None:
            env["ORDERLY_HANDLER_MODULES"] = handler_modules
        self.port = free_port()
        managed = self.procs.start_api(self.port, extra_env=env)
        if not self.token:
            self.token = api_key(self.db, name=f"stack-{uuid.uuid4().hex[:12]}")
        self._http = httpx.Client(
            base_url=self.url, timeout=10, headers={"Authorization": f"Bearer {self.token}"}
        )
        return managed

    def worker(
        self, name: str = "w1", *, concurrency: int = 2, node: str | None = "worker-node"
    ) -> Managed:
        """A worker process, once it consumes ("ready.")."""
        return self.workers({name: node}, concurrency=concurrency)[0]

    def workers(
        self,
        nodes: Mapping[str, str | None],
        *,
        concurrency: int = 1,
        prefetch: int | None = None,
    ) -> list[Managed]:
        """Worker processes (name -> node code) started at once, returned once all consume."""
        started = [
            self.procs.start_worker(
                name, concurrency=concurrency, node_code=node, prefetch=prefetch
            )
            for name, node in nodes.items()
        ]
        for managed in started:
            wait_for_log(managed, "ready.", timeout=START_TIMEOUT_S)
        return started

    def beat(self, *, node: str | None = "beat-node", name: str = "beat") -> Managed:
        """Beat, once its ticker runs: from then on due work (delays, retries, confirmations,
        wake-ups) goes to the broker. ``name``: its process's (and log's) name."""
        env = {"ORDERLY_NODE_CODE": node} if node is not None else None
        managed = self.procs.start_beat(name, extra_env=env)
        wait_for_log(managed, "ticker every", timeout=START_TIMEOUT_S)
        return managed

    def process(self, name: str) -> Managed:
        """A process started under this name."""
        return next(m for m in self.procs.procs if m.name == name)

    # --- the API ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def http(self) -> httpx.Client:
        assert self._http is not None, "start_api() first"
        return self._http

    def submit(self, body: Mapping[str, Any]) -> int:
        """POST /messages: a new message, its msg_id."""
        answer = self.http.post("/messages", json=dict(body))
        assert answer.status_code == 201, answer.text
        return int(answer.json()["msg_id"])

    def get(self, msg_id: int) -> dict[str, Any]:
        answer = self.http.get(f"/messages/{msg_id}")
        assert answer.status_code == 200, answer.text
        found: dict[str, Any] = answer.json()
        return found

    def state(self, msg_id: int) -> str:
        return str(self.get(msg_id)["state"])

    def wait_state(self, msg_id: int, state: str, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until the message is in ``state``; what GET /messages/{id} then shows."""
        wait_until(lambda: self.state(msg_id) == state, timeout, f"message {msg_id} {state}")
        return self.get(msg_id)

    def close(self) -> None:
        if self._http is not None:
            self._http.close()


def pool_children(worker: Managed) -> list[int]:
    """The pids of a worker's pool processes."""
    out = subprocess.run(
        ["pgrep", "-P", str(worker.proc.pid)], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]
