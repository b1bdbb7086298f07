"""orderly's Lua scripts (``worker/lua``), registered once per Redis client and run as a
:class:`Call`.

Each script is one atomic check-and-act; the shared library (``_lib.lua``) is prepended to
every one. A :class:`Call` is built by the typed function of its script (``orderly.worker.lua``,
the one place that names a script's KEYS and ARGV and reads its reply) and holds as many keys
as the script's header names. A script refuses with an error reply whose first word is a code;
:meth:`Scripts.run` turns it into the exception ``orderly.worker.core.errors`` maps it to.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from itertools import takewhile
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
    "lease_hold",
    "lease_give_up",
    # the wake-up of workers for due messages (worker/messages/wake.py)
    "wake",
    "wake_swap",
    # message tracking and service lifecycle
    "track_register",
    "track_done",
    "track_done_xid",
    "track_monitor",
    "service_register",
    "service_renew",
    "service_restore",
    # the HTTP API's rate limits (worker/core/ratelimit.py)
    "rate_take",
)


# A value a script takes in ARGV (Redis receives its text).
Arg = str | int | float
_HEADER_KEY = re.compile(r"\bKEYS\[(\d+)\]")


@cache
def key_count(name: str) -> int:
    """How many KEYS the script takes: the highest ``KEYS[i]`` its header (the comment lines it
    starts with) names."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"no Lua script named {name!r}")
    lines = (LUA_DIR / f"{name}.lua").read_text().splitlines()
    header = takewhile(lambda line: line.startswith("--"), lines)
    return max((int(n) for line in header for n in _HEADER_KEY.findall(line)), default=0)


@dataclass(frozen=True)
class Call:
    """One run of a script: its KEYS and ARGV in the script's order. A key count other than the
    header's is refused here, before Redis sees it."""

    script: str
    keys: tuple[str, ...]
    args: tuple[Arg, ...]

    def __post_init__(self) -> None:
        expected = key_count(self.script)
        if len(self.keys) != expected:
            raise ValueError(
                f"{self.script}.lua takes {expected} keys (its header), given {len(self.keys)}"
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
    """Registered scripts of one Redis client: ``scripts.run(call)``, a call built by
    ``orderly.worker.lua``."""

    def __init__(self, client: OrderingRedis) -> None:
        self.client = client
        self._scripts = {name: client.register_script(source(name)) for name in SCRIPT_NAMES}

    def run(self, call: Call) -> Any:
        try:
            return self._scripts[call.script](keys=call.keys, args=call.args)
        except redis.ResponseError as exc:
            mapped = from_script_error(str(exc))
            if mapped is None:
                raise
            raise mapped from None

    def run_each(self, calls: Sequence[Call], *, each_error: bool = False) -> list[Any]:
        """Every call, in one pipelined round trip per server (a Redis Cluster's client
        pipelines no scripts: each node's calls go in a pipeline of that node's own). A call
        its server could not run there (the script not loaded yet, its slot moved) runs again
        on its own, through the client. A call that fails raises, or with ``each_error`` is
        answered with its exception (as :meth:`run` raises it) in its place."""
        replies: list[Any] = [None] * len(calls)
        for indexes, client in self._by_server([call.keys[0] for call in calls]):
            pipe = client.pipeline(transaction=False)
            for i in indexes:
                call = calls[i]
                # By its SHA alone: a pipeline that registers scripts asks SCRIPT EXISTS
                # first, a round trip more; a server without it answers NOSCRIPT (below).
                sha = self._scripts[call.script].sha
                pipe.evalsha(sha, len(call.keys), *call.keys, *call.args)
            for i, reply in zip(indexes, pipe.execute(raise_on_error=False), strict=True):
                replies[i] = reply
        done = []
        for call, reply in zip(calls, replies, strict=True):
            try:
                if isinstance(reply, _AGAIN):
                    reply = self.run(call)
                elif isinstance(reply, redis.ResponseError):
                    raise from_script_error(str(reply)) or reply
                elif isinstance(reply, Exception):
                    raise reply
            except Exception as exc:
                if not each_error:
                    raise
                reply = exc
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
