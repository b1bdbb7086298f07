"""Consumers the pub/sub log tests give their workers (ORDERLY_HANDLER_MODULES)."""

from __future__ import annotations

from orderly.worker.pubsub import Claimed, consumers


class FirstAttemptFails(ValueError):
    pass


@consumers.register("test.fail_first")
def fail_first(event: Claimed) -> None:
    """Fails its first attempt of every event, processes the next (with some memory)."""
    if event.attempt == 0:
        raise FirstAttemptFails(f"attempt 0 of {event.correlation_id} fails")
    block = bytearray(2_000_000)  # processing that needs memory: the log measures it
    del block
