"""Every Redis key of conversation delivery, built in one place (the seed's names).

Lua scripts receive these through KEYS, or, where a script must reach a key named by a value
it read (a request list entry, a MinMessageInfo member), through the prefixes given here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class BridgeKeys:
    prefix: str = "bridge:queue"

    # --- the seed's keys ----------------------------------------------------------------
    def request(self, request_id: str) -> str:
        """Request hash (EXPIRES MESSAGE_TTL)."""
        return f"{self.prefix}:req:{request_id}"

    def response(self, response_id: str) -> str:
        """Response hash (EXPIRES AWAITED_MESSAGE_TTL)."""
        return f"{self.prefix}:res:{response_id}"

    def request_list(self, conversation_id: str) -> str:
        """The conversation's request list, oldest first (values are request keys)."""
        return f"{self.prefix}:{conversation_id}:req"

    def response_list(self, conversation_id: str) -> str:
        """The conversation's response sorted set: the order of delivery."""
        return f"{self.prefix}:{conversation_id}"

    @property
    def pending_messages(self) -> str:
        """pendingMessages: MinMessageInfo scored by when the awaited agent looks at it."""
        return f"{self.prefix}:pendingMessages"

    def async_request(self, async_response_id: str) -> str:
        """ACK identifier -> MinMessageInfo (EXPIRES SENT_MESSAGE_TTL)."""
        return f"{self.prefix}:asyncRequest:{async_response_id}"

    # --- orderly's additions ------------------------------------------------------------
    def request_seq(self, conversation_id: str) -> str:
        """Counter giving each request its position in the conversation (the order's key)."""
        return f"{self.prefix}:{conversation_id}:seq"

    def drain_lease(self, conversation_id: str) -> str:
        """Held by the one task delivering the conversation now; absent = nobody is."""
        return f"{self.prefix}:{conversation_id}:lease"

    @property
    def drains(self) -> str:
        """Running drains: conversation id -> ``pid|token|claimed ms``, the backend pid of the
        PostgreSQL connection the drain holds (its worker's liveness), the lease token it
        holds and when it last claimed a head."""
        return f"{self.prefix}:drains"

    @property
    def scheduled(self) -> str:
        """Conversations scored by when they are due again (a retry wait, an ACK deadline)."""
        return f"{self.prefix}:scheduled"

    @property
    def scheduled_leased(self) -> str:
        """Wake-ups a scheduler took, scored by when its lease ends (then due again)."""
        return f"{self.prefix}:scheduled:leased"

    # Prefixes for keys a script derives from values it read (see the module docstring).
    @property
    def request_prefix(self) -> str:
        return f"{self.prefix}:req:"

    @property
    def response_prefix(self) -> str:
        return f"{self.prefix}:res:"


# The Redis marker (worker/rebuild.py): a hash {generation, state, run_id} written once a
# rebuild from PostgreSQL is done. Missing, not "ready", or written under another server run
# (INFO server's run_id) means Redis lost (some of) what it held.
EPOCH_KEY = "orderly:epoch"

# Whether a worker is woken, or looking, for due messages (worker/wake.py): intake wakes one
# only when none is, or when the one looking is busy running handlers.
PROCESS_WAKE_KEY = "orderly:process:wake"


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
    def retry(self) -> str:
        """Timed-out messages scored by when their retry is due (ms)."""
        return f"{self.namespace}:message:retry"

    @property
    def retry_leased(self) -> str:
        """Retries taken by a scheduler, scored by when its lease ends (then due again)."""
        return f"{self.namespace}:message:retry:leased"

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
