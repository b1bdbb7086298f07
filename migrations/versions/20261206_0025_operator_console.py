"""operator console: correlation search, node state notes

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-06 14:00:00

``ix_message_correlation_pattern``: ``correlation_id`` under ``text_pattern_ops``, so that a
listing's ``correlation_match=prefix`` (LIKE 'prefix%') is an index range scan whatever the
database's collation. ``node.state_changed_at``, ``state_changed_by`` and ``state_note``: an
operator's last change of a node's state, who made it and why.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_message_correlation_pattern",
        "message",
        ["correlation_id"],
        postgresql_ops={"correlation_id": "text_pattern_ops"},
    )
    op.add_column("node", sa.Column("state_changed_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("node", sa.Column("state_changed_by", sa.String(200), nullable=True))
    op.add_column("node", sa.Column("state_note", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("node", "state_note")
    op.drop_column("node", "state_changed_by")
    op.drop_column("node", "state_changed_at")
    op.drop_index("ix_message_correlation_pattern", table_name="message")
