"""orderly's Lua scripts (``worker/lua``), registered once per Redis client and run by name.

Each script is one atomic check-and-act; the shared library (``_lib.lua``) is prepended to
every one. A script refuses with an error reply whose first word is a code; :meth:`run`
turns it into the exception ``orderly.worker.core.errors`` maps it to.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import redis
from redis.cluster import RedisCluster

from orderly.worker.core.clients import OrderingRedis
from orderly.worker.core.errors import from_script_error

LUA_DIR = Path(__file__).resolve().parent.parent / "lua"
SCRIPT_NAMES = (
    # conversations
    "register_request",
    "add_response",
    "advance",
    "ack",
    "ack_inflight",
    "expire",
    "awaited",
    "rebuild_conversation",
    "drain_release",
    # operators' conversation operations (worker/conversations/operations.py)
    "conv_delete",
    "conv_set_awaited",
    "conv_awaited_date",
    "conv_remove_at",
    "conv_remove_due",
    # the Redis marker (worker/rebuild.py)
    "epoch_ready",
    # due sets and leases
    "due_take",
    "due_settle",
    "due_release",
    "lease_take",
    "lease_give_up",
    # the wake-up of workers for due messages (worker/messages/wake.py)
    "wake",
    "wake_swap",
    # message tracking and service lifecycle
    "track_register",
    "track_done",
    "track_monitor",
    "service_register",
    "service_renew",
    "service_restore",
    # the HTTP API's rate limits (worker/core/ratelimit.py)
    "rate_take",
)


@cache
def source(name: str) -> str:
    if name not in SCRIPT_NAMES:
        raise KeyError(f"no Lua script named {name!r}")
    library = (LUA_DIR / "_lib.lua").read_text()
    return library + "\n" + (LUA_DIR / f"{name}.lua").read_text()


def as_text(value: Any) -> str:
    """A Redis reply value as text (clients may or may not be set to decode replies)."""
    return value.decode() if isinstance(value, bytes) else str(value)


class Scripts:
    """Registered scripts of one Redis client: ``scripts.run("advance", keys, args)``."""

    def __init__(self, client: OrderingRedis) -> None:
        self.client = client
        self._scripts = {name: client.register_script(source(name)) for name in SCRIPT_NAMES}

    def run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return self._scripts[name](keys=keys, args=args)
        except redis.ResponseError as exc:
            mapped = from_script_error(str(exc))
            if mapped is None:
                raise
            raise mapped from None

    def run_each(self, name: str, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        """The script once per (keys, args), in one pipelined round trip per server (a Redis
        Cluster's client pipelines no scripts: each node's calls go in a pipeline of that
        node's own). A call its server could not run there (the script not loaded yet, its
        slot moved) runs again on its own, through the client."""
        script = self._scripts[name]
        replies: list[Any] = [None] * len(calls)
        for indexes, client in self._by_server([keys[0] for keys, _ in calls]):
            pipe = client.pipeline(transaction=False)
            for i in indexes:
                keys, args = calls[i]
                # By its SHA alone: a pipeline that registers scripts asks SCRIPT EXISTS
                # first, a round trip more; a server without it answers NOSCRIPT (below).
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            for i, reply in zip(indexes, pipe.execute(raise_on_error=False), strict=True):
                replies[i] = reply
        done = []
        for (keys, args), reply in zip(calls, replies, strict=True):
            if isinstance(reply, _AGAIN):
                reply = self.run(name, keys, args)
            elif isinstance(reply, Exception):
                raise reply
            done.append(reply)
        return done

    def _by_server(self, first_keys: list[str]) -> list[tuple[list[int], redis.Redis]]:
        if not isinstance(self.client, RedisCluster):
            return [(list(range(len(first_keys))), self.client)]
        groups: dict[str, tuple[list[int], redis.Redis]] = {}
        for i, key in enumerate(first_keys):
            node = self.client.get_node_from_key(key)  # type: ignore[no-untyped-call]
            if node.name not in groups:
                groups[node.name] = ([], self.client.get_redis_connection(node))
            groups[node.name][0].append(i)
        return list(groups.values())


# A pipelined call that runs again on its own: its server lacked the script, or no longer
# holds its slot.
_AGAIN = (
    redis.exceptions.NoScriptError,
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
)
