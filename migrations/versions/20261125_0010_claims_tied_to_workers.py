"""deliveries and confirmation tries record the worker connection that holds them

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 09:00:00

``claim_pid`` is the PostgreSQL backend pid of the connection a worker holds while it sends a
delivery batch or a confirmation: when that backend is gone, the worker died, and beat
releases the claim within a second instead of waiting out a lease. ``lost_count`` counts the
claims that died with their worker; at ORDERLY_WORKER_LOST_LIMIT the item is quarantined
(a delivery DEAD, a confirmation FAILED_END, with E_WORKER_LOST).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("delivery", "external_call")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("claim_pid", sa.Integer(), nullable=True))
        op.add_column(
            table, sa.Column("lost_count", sa.Integer(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    for table in TABLES:
        op.drop_column(table, "lost_count")
        op.drop_column(table, "claim_pid")
