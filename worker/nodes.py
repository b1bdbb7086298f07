"""The node table: who takes part, in which state, and who is alive."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Engine

from orderly.models import NodeState
from orderly.worker.core.clock import SYSTEM, Clock
from orderly.worker.core.errors import InvalidMessage, NodeNotAccepting, NodeNotFound
from orderly.worker.db.prepared import PreparedConnection
from orderly.worker.db.queries import sql

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeView:
    node_id: int
    code: str
    state: NodeState
    last_heartbeat: datetime | None
    alive: bool
    # an operator's last change of state: when, by whom, why
    state_changed_at: datetime | None = None
    state_changed_by: str | None = None
    state_note: str | None = None


def register_node(engine: Engine, code: str, description: str | None = None) -> int:
    """Create the node in RUN if it is new and return its id.

    An existing node keeps the state an operator gave it: a stopped node that restarts stays
    stopped until ``orderly node run``.
    """
    with engine.begin() as conn:
        conn.execute(sql("node_register"), {"code": code, "description": description})
        return int(conn.execute(sql("node_registered"), {"code": code}).scalar_one())


def heartbeat(engine: Engine, node_id: int) -> NodeState:
    """Renew the node's heartbeat and return its current state."""
    with engine.begin() as conn:
        state = conn.execute(sql("node_heartbeat"), {"id": node_id}).scalar()
    if state is None:
        raise NodeNotFound(str(node_id))
    return NodeState(state)


def set_state(
    engine: Engine,
    code: str,
    state: NodeState,
    *,
    by: str | None = None,
    note: str | None = None,
) -> None:
    """An operator moves a node to ``state``; ``by`` (who) and ``note`` (why) are kept with it
    and logged."""
    if note is not None and len(note) > 1000:
        raise InvalidMessage("note", "must be at most 1000 characters")
    params = {"code": code, "state": state.value, "by": by, "note": note}
    with engine.begin() as conn:
        row = conn.execute(sql("node_set_state"), params).first()
    if row is None:
        raise NodeNotFound(code)
    log.warning("node %s set to %s by %s: %s", code, state.value, by or "operator", note or "")


def node_state(engine: Engine, node_id: int) -> NodeState:
    with engine.connect() as conn:
        state = conn.execute(sql("node_state"), {"id": node_id}).scalar()
    if state is None:
        raise NodeNotFound(str(node_id))
    return NodeState(state)


@dataclass(frozen=True)
class CodeState:
    code: str
    state: str


def refusal(conn: PreparedConnection | Connection, node_id: int) -> NodeNotAccepting:
    """Why an insert that needed the node in RUN inserted nothing (it checks the node in the
    same statement: this only names the state it met)."""
    if isinstance(conn, PreparedConnection):
        row = conn.one(CodeState, "orderly_node_state", node_id)
    else:
        found = conn.execute(sql("node_code_state"), {"id": node_id}).first()
        row = None if found is None else CodeState(found.code, found.state)
    if row is None:
        raise NodeNotFound(str(node_id))
    return NodeNotAccepting(row.code, row.state)


class NodeFollower:
    """A process's view of its node's state, renewed (with its heartbeat, or only read when
    ``beat`` is False) at most once per ``every_s``; an unreachable PostgreSQL keeps the last
    state seen."""

    def __init__(
        self,
        engine: Engine,
        node_id: int,
        every_s: float,
        clock: Clock = SYSTEM,
        *,
        beat: bool = True,
    ) -> None:
        self._engine = engine
        self._node_id = node_id
        self._every_s = every_s
        self._clock = clock
        self._renew = heartbeat if beat else node_state
        self._next = float("-inf")
        self.state = node_state(engine, node_id)
        if self.state is not NodeState.RUN:
            log.warning("node %s is %s", node_id, self.state.value)

    def follow(self) -> NodeState:
        now = self._clock.monotonic()
        if now >= self._next:
            self._next = now + self._every_s
            before = self.state
            try:
                self.state = self._renew(self._engine, self._node_id)
            except Exception:
                log.exception("node heartbeat failed (tried again in %.1f s)", self._every_s)
            if self.state is not before:
                log.warning("node %s is %s", self._node_id, self.state.value)
        return self.state

    @property
    def stopped(self) -> bool:
        return self.state is NodeState.STOPPED


def list_nodes(engine: Engine, heartbeat_timeout_s: int) -> list[NodeView]:
    with engine.connect() as conn:
        rows = conn.execute(sql("node_list"), {"timeout_s": heartbeat_timeout_s}).all()
    return [
        NodeView(
            r.node_id,
            r.code,
            NodeState(r.state),
            r.last_heartbeat,
            bool(r.alive),
            r.state_changed_at,
            r.state_changed_by,
            r.state_note,
        )
        for r in rows
    ]
