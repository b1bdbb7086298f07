"""The node table: who takes part, in which state, and who is alive."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine

from models import NodeState
from worker.core.errors import NodeNotFound
from worker.store.queries import sql


@dataclass(frozen=True)
class NodeView:
    node_id: int
    code: str
    state: NodeState
    last_heartbeat: datetime | None
    alive: bool


def register_node(engine: Engine, code: str, description: str | None = None) -> int:
    """Create the node in RUN if it is new and return its id.

    An existing node keeps the state an operator gave it: a stopped node that restarts stays
    stopped until ``orderly node run``.
    """
    with engine.begin() as conn:
        found = conn.execute(sql("node_register"), {"code": code, "description": description})
        return int(found.scalar_one())


def heartbeat(engine: Engine, node_id: int) -> NodeState:
    """Renew the node's heartbeat and return its current state."""
    with engine.begin() as conn:
        state = conn.execute(sql("node_heartbeat"), {"id": node_id}).scalar()
    if state is None:
        raise NodeNotFound(str(node_id))
    return NodeState(state)


def set_state(engine: Engine, code: str, state: NodeState) -> None:
    with engine.begin() as conn:
        row = conn.execute(sql("node_set_state"), {"code": code, "state": state.value}).first()
    if row is None:
        raise NodeNotFound(code)


def node_state(engine: Engine, node_id: int) -> NodeState:
    with engine.connect() as conn:
        state = conn.execute(sql("node_state"), {"id": node_id}).scalar()
    if state is None:
        raise NodeNotFound(str(node_id))
    return NodeState(state)


def list_nodes(engine: Engine, heartbeat_timeout_s: int) -> list[NodeView]:
    with engine.connect() as conn:
        rows = conn.execute(sql("node_list"), {"timeout_s": heartbeat_timeout_s}).all()
    return [
        NodeView(r.node_id, r.code, NodeState(r.state), r.last_heartbeat, bool(r.alive))
        for r in rows
    ]
