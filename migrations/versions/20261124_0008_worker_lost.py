"""message.lost_count: the claims of a message that died with their worker

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 12:00:00

A message whose worker dies while it holds the claim is released at once and counted here;
at ORDERLY_WORKER_LOST_LIMIT it is quarantined (FAILED, E_WORKER_LOST) instead of being
claimed again (worker.messages.watchdogs.release_orphans).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "message", sa.Column("lost_count", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("message", "lost_count")
