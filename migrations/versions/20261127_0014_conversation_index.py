"""a conversation's messages found by its id: ix_message_conversation

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 09:00:00

A conversation's requests and responses are rows with ``service_name = 'conversation'`` and
the conversation id in ``process_id``. The console shows a conversation's history from them;
the index is partial, so only conversation rows pay for it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_message_conversation",
        "message",
        ["process_id", "msg_timestamp", "msg_id"],
        postgresql_where=sa.text("service_name = 'conversation'"),
    )


def downgrade() -> None:
    op.drop_index("ix_message_conversation", table_name="message")
