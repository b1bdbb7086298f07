"""Every Redis key of conversation delivery, built in one place (the seed's names).

Lua scripts receive these through KEYS, or, where a script must reach a key named by a value
it read (a request list entry, a MinMessageInfo member), through the prefixes given here.

Redis Cluster: a script's keys, and the keys it derives from what it read, must all hash to
one slot. Conversations are therefore spread over ``shards`` shards (the conversation id's
CRC-32 modulo the count), and every key carries its shard's hash tag, ``{bq:<count>:<n>}``:
a conversation's own keys, its requests' and responses' hashes, their ACK keys, and its
shard's sets (pendingMessages, scheduled, the running drains, the marker) share one slot. The
count is part of the tag, so a layout with another count shares no key with this one (a
change of count is a rebuild, worker/rebuild.py). docs/redis-cluster.md has the table.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from functools import cached_property

# Shards of the conversation keys by default (ORDERLY_REDIS_SHARDS): on one Redis, and on a
# Redis Cluster, where 64 hash tags spread evenly over three primaries (21/21/22; 16 fall
# 3/8/5) and about as evenly over more.
DEFAULT_SHARDS = 16
CLUSTER_SHARDS = 64
SHARD_TAG = "bq"


def shard_number(conversation_id: str, shards: int) -> int:
    """The shard a conversation belongs to: stable across processes and restarts."""
    return zlib.crc32(conversation_id.encode()) % shards


@dataclass(frozen=True)
class ShardKeys:
    """The keys of one shard: its sets, and the hashes of its conversations' requests and
    responses (their ids are unique per conversation, so per shard)."""

    base: str  # "<prefix>:{bq:<count>:<n>}"
    number: int

    # --- the seed's keys ----------------------------------------------------------------
    def request(self, request_id: str) -> str:
        """Request hash (EXPIRES MESSAGE_TTL)."""
        return f"{self.base}:req:{request_id}"

    def response(self, response_id: str) -> str:
        """Response hash (EXPIRES AWAITED_MESSAGE_TTL)."""
        return f"{self.base}:res:{response_id}"

    @property
    def pending_messages(self) -> str:
        """pendingMessages: MinMessageInfo scored by when the awaited agent looks at it."""
        return f"{self.base}:pendingMessages"

    def async_request(self, async_response_id: str) -> str:
        """ACK identifier -> MinMessageInfo (EXPIRES SENT_MESSAGE_TTL)."""
        return f"{self.base}:asyncRequest:{async_response_id}"

    # --- orderly's additions ------------------------------------------------------------
    @property
    def drains(self) -> str:
        """Running drains: conversation id -> ``pid|token|claimed ms``, the backend pid of the
        PostgreSQL connection the drain holds (its worker's liveness), the lease token it
        holds and when it last claimed a head."""
        return f"{self.base}:drains"

    @property
    def scheduled(self) -> str:
        """Conversations scored by when they are due again (a retry wait, an ACK deadline)."""
        return f"{self.base}:scheduled"

    @property
    def scheduled_leased(self) -> str:
        """Wake-ups a scheduler took, scored by when its lease ends (then due again)."""
        return f"{self.base}:scheduled:leased"

    @property
    def epoch(self) -> str:
        """The shard's Redis marker (worker/rebuild.py): a hash {generation, state, run_id,
        shards} written once a rebuild from PostgreSQL is done. Missing, not "ready", or
        written under another server run (INFO server's run_id of the node holding it) means
        Redis lost (some of) what it held."""
        return f"{self.base}:epoch"

    # Prefixes for keys a script derives from values it read (see the module docstring).
    @property
    def request_prefix(self) -> str:
        return f"{self.base}:req:"

    @property
    def response_prefix(self) -> str:
        return f"{self.base}:res:"

    @property
    def async_prefix(self) -> str:
        return f"{self.base}:asyncRequest:"

    @property
    def conversation_prefix(self) -> str:
        """A conversation's response order is this prefix and its id (BridgeKeys.response_list)."""
        return f"{self.base}:"


@dataclass(frozen=True)
class BridgeKeys:
    prefix: str = "bridge:queue"
    shards: int = DEFAULT_SHARDS

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError("shards must be at least 1")
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError("the prefix may not hold { or }: they would move the hash tag")

    @cached_property
    def every_shard(self) -> tuple[ShardKeys, ...]:
        """Every shard, in order: what the agents walk."""
        return tuple(ShardKeys(f"{self.layout}{n}}}", n) for n in range(self.shards))

    @property
    def layout(self) -> str:
        """What every key of this layout starts with (``<prefix>:{bq:<count>:``); keys under
        the prefix that do not are another layout's (worker/rebuild.py removes them)."""
        return f"{self.prefix}:{{{SHARD_TAG}:{self.shards}:"

    def shard(self, conversation_id: str) -> ShardKeys:
        """The shard of a conversation."""
        return self.every_shard[shard_number(conversation_id, self.shards)]

    # --- the seed's keys ----------------------------------------------------------------
    def request(self, conversation_id: str, request_id: str) -> str:
        """Request hash (EXPIRES MESSAGE_TTL), in its conversation's shard."""
        return self.shard(conversation_id).request(request_id)

    def response(self, conversation_id: str, response_id: str) -> str:
        """Response hash (EXPIRES AWAITED_MESSAGE_TTL), in its conversation's shard."""
        return self.shard(conversation_id).response(response_id)

    def request_list(self, conversation_id: str) -> str:
        """The conversation's request list, oldest first (values are request keys)."""
        return f"{self.shard(conversation_id).base}:{conversation_id}:req"

    def response_list(self, conversation_id: str) -> str:
        """The conversation's response sorted set: the order of delivery."""
        return f"{self.shard(conversation_id).base}:{conversation_id}"

    # --- orderly's additions ------------------------------------------------------------
    def request_seq(self, conversation_id: str) -> str:
        """Counter giving each request its position in the conversation (the order's key)."""
        return f"{self.shard(conversation_id).base}:{conversation_id}:seq"

    def drain_lease(self, conversation_id: str) -> str:
        """Held by the one task delivering the conversation now; absent = nobody is."""
        return f"{self.shard(conversation_id).base}:{conversation_id}:lease"


@dataclass(frozen=True)
class RateKeys:
    """The token buckets of the HTTP API's rate limits (worker/core/ratelimit.py): each a hash
    {tokens, ms} that expires when it would be full again. Plain keys of ORDERLY_REDIS_URL's
    Redis, one per bucket; a client address or a key name is the last part of its key."""

    prefix: str = "orderly:rate"

    def address(self, address: str) -> str:
        """Every request of a client address."""
        return f"{self.prefix}:address:{address}"

    def key(self, name: str) -> str:
        """Every request authenticated by the API key of that name."""
        return f"{self.prefix}:key:{name}"

    def refused(self, address: str) -> str:
        """A client address's credentials refused: API keys and ACK tokens that match none."""
        return f"{self.prefix}:refused:{address}"

    def login_address(self, address: str) -> str:
        """The console's sign-ins from a client address."""
        return f"{self.prefix}:login:address:{address}"

    def login_key(self, prefix: str) -> str:
        """The console's sign-ins with a token naming that key (its prefix)."""
        return f"{self.prefix}:login:key:{prefix}"

    def funnel(self, funnel_key: int) -> str:
        """The starts of one funnel value's messages whose component has a rate (funnel_limit;
        the funnel's advisory-lock key names it)."""
        return f"{self.prefix}:funnel:{funnel_key}"

    def endpoint(self, subscription_id: int) -> str:
        """The sends to one PUSH subscription's endpoint whose pace has a rate
        (``subscription.rate_per_s``)."""
        return f"{self.prefix}:endpoint:{subscription_id}"


# Whether a worker is woken, or looking, for due messages (worker/messages/wake.py): intake
# wakes one only when none is, or when the one looking is busy running handlers.
PROCESS_WAKE_KEY = "orderly:process:wake"

# The beat that runs the agents (worker.core.lease.Leadership): one among the nodes' beats.
BEAT_LEADER_KEY = "orderly:beat:leader"

# Cancelled messages whose handlers may be running (worker/messages/abort.py): a stream of entries
# {msg: <msg_id>}, trimmed by age, that every worker process reads on from its last entry.
PROCESS_ABORTS_KEY = "orderly:process:aborts"


def console_session(session_digest: str) -> str:
    """A console session (worker/sessions.py), named by the SHA-256 of its id rather than the
    id: the keys of a Redis dump are no cookies. Expires at the session's idle or absolute
    end."""
    return f"orderly:console:session:{session_digest}"


def min_message_info(request_id: str, response_id: str, conversation_id: str) -> str:
    """The seed's MinMessageInfo string: fixed field order, so equal messages are equal strings."""
    return json.dumps(
        {"rqId": request_id, "rsId": response_id, "cnId": conversation_id},
        separators=(",", ":"),
        ensure_ascii=False,
    )


@dataclass(frozen=True)
class TrackKeys:
    """The tracking keys of message-tracking-timeouts.txt under ``serviceNamespace``.

    Message tracking: ``:message:id`` (counter), ``:message:$id`` (hash: timestamp, xid,
    deadline, service; expires after messageExpire), ``:message:ids`` (tracked ids, newest
    first), ``:message:xid:$xid`` (id and xid type), ``:message:done`` (ids the workers
    finished), ``:metrics:$name`` (count, sum, max and histogram buckets). Service lifecycle:
    ``:service:id`` (counter), ``:service:$id`` (expiring, renewed hash of one worker).
    """

    namespace: str = "orderly:track"

    # --- the seed's keys ----------------------------------------------------------------
    @property
    def message_id(self) -> str:
        return f"{self.namespace}:message:id"

    def message(self, track_id: int | str) -> str:
        return f"{self.namespace}:message:{track_id}"

    @property
    def message_ids(self) -> str:
        return f"{self.namespace}:message:ids"

    def xid(self, xid: str) -> str:
        return f"{self.namespace}:message:xid:{xid}"

    @property
    def done(self) -> str:
        return f"{self.namespace}:message:done"

    def metrics(self, name: str) -> str:
        return f"{self.namespace}:metrics:{name}"

    @property
    def service_id(self) -> str:
        return f"{self.namespace}:service:id"

    def service(self, service_id: int | str) -> str:
        return f"{self.namespace}:service:{service_id}"

    def service_mark(self, service_id: int | str) -> str:
        """Beside a live service's key, renewed with it and left alone by an operator's stop:
        the key gone with its mark means Redis lost its data (FLUSHALL, a restart without
        persistence), not that an operator removed the key."""
        return f"{self.namespace}:service:{service_id}:mark"

    # --- orderly's additions ------------------------------------------------------------
    def attempts(self, xid: str) -> str:
        """Timeouts counted against one xid so far (the retry's attempt number)."""
        return f"{self.namespace}:message:attempts:{xid}"

    @property
    def services(self) -> str:
        """Ids of the services registered and not yet seen gone."""
        return f"{self.namespace}:service:ids"

    # Prefixes for keys a script derives from values it made or read.
    @property
    def message_prefix(self) -> str:
        return f"{self.namespace}:message:"

    @property
    def xid_prefix(self) -> str:
        return f"{self.namespace}:message:xid:"

    @property
    def attempts_prefix(self) -> str:
        return f"{self.namespace}:message:attempts:"


@dataclass(frozen=True)
class PullKeys:
    """The Redis channels that tell waiting PULL consumers an event is there: one per PULL
    subscription (PUBLISH after a publish commits), listened to by pattern, once per API
    process (worker.pubsub.waiting)."""

    prefix: str = "orderly:pull"

    def channel(self, subscription_id: int) -> str:
        return f"{self.prefix}:{subscription_id}"

    @property
    def pattern(self) -> str:
        return f"{self.prefix}:*"

    def subscription_of(self, channel: str) -> int | None:
        head, _, tail = channel.rpartition(":")
        return int(tail) if head == self.prefix and tail.isdigit() else None
