"""The sink as tests and benchmarks use it: served from a background thread, with a client
for its recordings; and the foreground command (``python -m tooling.sink``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from tooling.sink.behaviour import Behaviour, BehaviourError
from tooling.sink.server import _base_url, _Server
from tooling.sink.state import _AckSender, _State


class Sink:
    """The sink served from a background thread; ``url`` is the channel URL to give orderly."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        behaviour: Mapping[str, Any] | None = None,
        path: str = "/deliver",
        ack_workers: int = 4,
    ) -> None:
        if not path.startswith("/") or path.startswith("/_sink/"):
            raise ValueError(f"delivery path must start with / and not /_sink/: {path!r}")
        self._host = host
        self._port = port
        self._path = path
        self._state = _State(Behaviour.parse(dict(behaviour or {})))
        self._ack_workers = ack_workers
        self._acks: _AckSender | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> Sink:
        if self._thread is not None:
            raise RuntimeError("sink already started")
        self._acks = _AckSender(self._state, self._ack_workers)
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="sink", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            self._acks.close()
            raise self._error
        return self

    def _run(self) -> None:
        assert self._acks is not None
        loop = asyncio.new_event_loop()
        server = _Server(self._state, self._acks)
        try:
            self._port = loop.run_until_complete(server.start(self._host, self._port))
        except BaseException as exc:
            self._error = exc
            loop.close()
            self._ready.set()
            return
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(server.close())
            loop.close()

    def stop(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None:
            return
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._thread = None
        self._loop = None
        if self._acks is not None:
            self._acks.close()
            self._acks = None

    def __enter__(self) -> Sink:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        """Where the control endpoints live (``/_sink/...``)."""
        return _base_url(self._host, self._port)

    @property
    def url(self) -> str:
        """The channel URL for orderly; any path but ``/_sink/...`` is a delivery."""
        return self.base_url + self._path

    @property
    def behaviour(self) -> dict[str, Any]:
        return self._state.behaviour.as_dict()

    def configure(self, **behaviour: Any) -> None:
        """Replace the behaviour (unset fields take their defaults); BehaviourError if invalid."""
        self._state.configure(Behaviour.parse(behaviour))

    def reset(self) -> None:
        """Forget every arrival, attempt count and delivery; rule counts start over."""
        self._state.reset()

    def arrivals(self, since: int = 0) -> list[dict[str, Any]]:
        return self._state.arrivals(since)

    def deliveries(self) -> dict[str, list[str]]:
        return self._state.deliveries()


async def _serve_until_signalled(
    host: str, port: int, behaviour: Behaviour, ack_workers: int
) -> None:
    state = _State(behaviour)
    acks = _AckSender(state, ack_workers)
    server = _Server(state, acks)
    try:
        bound = await server.start(host, port)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        print(f"sink listening on {_base_url(host, bound)}", flush=True)
        await stopping.wait()
    finally:
        await server.close()
        acks.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tooling.sink", description="Run the client sink in the foreground."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8500)
    parser.add_argument("--behaviour", default=None, help="initial behaviour, a JSON object")
    parser.add_argument("--ack-workers", type=int, default=4, help="threads sending ACKs")
    args = parser.parse_args(argv)
    try:
        behaviour = Behaviour.parse(json.loads(args.behaviour) if args.behaviour else {})
    except json.JSONDecodeError as exc:
        parser.error(f"--behaviour is not JSON: {exc}")
    except BehaviourError as exc:
        parser.error(f"--behaviour: {exc}")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_serve_until_signalled(args.host, args.port, behaviour, args.ack_workers))
    except OSError as exc:
        print(f"sink: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0
