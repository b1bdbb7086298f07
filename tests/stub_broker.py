"""A broker for tests (``orderly.worker.broker.Broker``): it keeps what was sent, in order, and
sends nothing; given to the runtime with ``Runtime.use_broker`` or to ``create_app(broker=...)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class StubBroker:
    """What the faces sent, by kind. ``reachable`` False: :meth:`ping` fails as a broker down
    would."""

    processing: list[int] = field(default_factory=list)
    # Each a worker woken for due messages: True the owner, False a helper.
    due: list[bool] = field(default_factory=list)
    drains: list[tuple[str, str]] = field(default_factory=list)
    event_deliveries: list[list[int]] = field(default_factory=list)
    confirmations: list[list[tuple[int, str]]] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    reachable: bool = True

    @property
    def queues(self) -> tuple[str, ...]:
        return ("stub.process", "stub.deliver")

    def enqueue_processing(self, msg_id: int) -> None:
        self.processing.append(msg_id)

    def send_process_due(self) -> None:
        self.due.append(True)

    def send_process_helper(self) -> None:
        self.due.append(False)

    def enqueue_drain(self, conversation_id: str, token: str) -> None:
        self.drains.append((conversation_id, token))

    def enqueue_event_deliveries(self, delivery_ids: list[int]) -> None:
        self.event_deliveries.append(list(delivery_ids))

    def enqueue_confirmations(self, calls: list[tuple[int, str]]) -> None:
        self.confirmations.append(list(calls))

    def figures(self) -> None:
        return None

    def ping(self, timeout_s: float) -> None:
        if not self.reachable:
            raise ConnectionRefusedError("the stub broker is down")

    def run_command(self, argv: Sequence[str]) -> int | None:
        self.commands.append(list(argv))
        return 0
