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
    def scheduled(self) -> str:
        """Conversations scored by when they are due again (a retry wait, an ACK deadline)."""
        return f"{self.prefix}:scheduled"

    # Prefixes for keys a script derives from values it read (see the module docstring).
    @property
    def request_prefix(self) -> str:
        return f"{self.prefix}:req:"

    @property
    def response_prefix(self) -> str:
        return f"{self.prefix}:res:"


def min_message_info(request_id: str, response_id: str, conversation_id: str) -> str:
    """The seed's MinMessageInfo string: fixed field order, so equal messages are equal strings."""
    return json.dumps(
        {"rqId": request_id, "rsId": response_id, "cnId": conversation_id},
        separators=(",", ":"),
        ensure_ascii=False,
    )
