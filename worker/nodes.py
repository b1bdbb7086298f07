"""The node table: who takes part, in which state, and who is alive."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from models import Node, NodeState
from worker.core.errors import NodeNotFound


def register_node(engine: Engine, code: str, description: str | None = None) -> int:
    """Create the node in RUN if it is new and return its id.

    An existing node keeps the state an operator gave it: a stopped node that restarts stays
    stopped until ``orderly node run``.
    """
    stmt = (
        insert(Node)
        .values(
            code=code,
            name=code,
            description=description,
            state=NodeState.RUN,
            last_heartbeat=func.now(),
        )
        .on_conflict_do_update(index_elements=[Node.code], set_={"last_heartbeat": func.now()})
        .returning(Node.node_id)
    )
    with Session(engine) as session, session.begin():
        return int(session.execute(stmt).scalar_one())


def heartbeat(engine: Engine, node_id: int) -> NodeState:
    """Renew the node's heartbeat and return its current state."""
    stmt = (
        update(Node)
        .where(Node.node_id == node_id)
        .values(last_heartbeat=func.now())
        .returning(Node.state)
    )
    with Session(engine) as session, session.begin():
        state = session.execute(stmt).scalar_one_or_none()
    if state is None:
        raise NodeNotFound(str(node_id))
    return NodeState(state)


def set_state(engine: Engine, code: str, state: NodeState) -> Node:
    with Session(engine) as session, session.begin():
        node = session.scalars(select(Node).where(Node.code == code).with_for_update()).first()
        if node is None:
            raise NodeNotFound(code)
        node.state = state
    return node


def node_state(engine: Engine, node_id: int) -> NodeState:
    with Session(engine) as session:
        state = session.scalar(select(Node.state).where(Node.node_id == node_id))
    if state is None:
        raise NodeNotFound(str(node_id))
    return NodeState(state)


@dataclass(frozen=True)
class NodeView:
    node_id: int
    code: str
    state: NodeState
    last_heartbeat: datetime | None
    alive: bool


def list_nodes(engine: Engine, heartbeat_timeout_s: int) -> list[NodeView]:
    with Session(engine) as session:
        now = session.scalar(select(func.now()))
        rows = session.scalars(select(Node).order_by(Node.code)).all()
    assert now is not None
    limit = timedelta(seconds=heartbeat_timeout_s)
    return [
        NodeView(
            node_id=n.node_id,
            code=n.code,
            state=n.state,
            last_heartbeat=n.last_heartbeat,
            alive=n.last_heartbeat is not None and now - n.last_heartbeat <= limit,
        )
        for n in rows
    ]
