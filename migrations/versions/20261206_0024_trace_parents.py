"""trace parents: the W3C traceparent a message or an event was stored under

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-06 13:00:00

``message.trace_parent`` and ``event.trace_parent``: the span that took the message or event
in (the API request's, a parent handler's), so that the worker running its handler or sending
it continues the same trace (worker/core/tracing.py). NULL while tracing is off.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("message", sa.Column("trace_parent", sa.String(64), nullable=True))
    op.add_column("event", sa.Column("trace_parent", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("event", "trace_parent")
    op.drop_column("message", "trace_parent")
