"""The broker as one object: every way orderly hands work to its workers, named in one protocol.

The faces (the HTTP API, the console, the CLI, beat's agents) take the process's broker from
the runtime (``get_runtime().broker``) and pass its methods to the mechanisms, which know only
callables (``enqueue: Callable[[int], None]``). The Celery implementation is
``orderly.worker.celery.CeleryBroker`` (its one instance, ``orderly.worker.celery.broker``);
a test gives the runtime a broker of its own with ``Runtime.use_broker``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from orderly.worker.observe import BrokerFigures


@runtime_checkable
class Broker(Protocol):
    """What orderly sends through its broker. A send returns once the broker took the task;
    it raises when the broker cannot be reached (the caller's transaction has committed:
    beat's repair finds the work again)."""

    @property
    def queues(self) -> tuple[str, ...]:
        """The queues tasks are routed to (their depths are the metrics' broker figures)."""
        ...

    def enqueue_processing(self, msg_id: int) -> None:
        """Process one message (``orderly.process.message``)."""
        ...

    def send_process_due(self) -> None:
        """A worker that claims due messages while there are any (``orderly.process.due``).
        Faces wake one through ``Runtime.wake_processing``, which sends this at most once
        while one is pending (worker/messages/wake.py)."""
        ...

    def send_process_helper(self) -> None:
        """A second worker for due messages, beside the one woken (a full claim asks for it,
        worker.messages.batches.run_woken)."""
        ...

    def enqueue_drain(self, conversation_id: str, token: str) -> None:
        """Deliver a conversation's responses in order; the caller holds its lease under
        ``token`` and hands it over."""
        ...

    def enqueue_event_deliveries(self, delivery_ids: list[int]) -> None:
        """Deliver these events to their subscriptions (one task for them all)."""
        ...

    def enqueue_confirmations(self, calls: list[tuple[int, str]]) -> None:
        """Confirmation tries: (external call id, the claim token it was taken under)."""
        ...

    def figures(self) -> BrokerFigures | None:
        """The tasks waiting in each of :attr:`queues`, and those taken and not acknowledged
        when the broker tells; None when it cannot be read (``orderly status``, GET /metrics)."""
        ...

    def ping(self, timeout_s: float) -> None:
        """Connect to the broker once (GET /ready, ``orderly settings --check``); raises when
        it cannot be reached within ``timeout_s``."""
        ...

    def run_command(self, argv: Sequence[str]) -> int | None:
        """Run one of the broker's own processes in this one (``worker``, ``beat``,
        ``flower`` and their options: ``orderly worker|beat|flower``); its exit code."""
        ...
