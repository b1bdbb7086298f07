"""a conversation's open rows found without its history: ix_message_conversation_open

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-07 04:40:00

A request's insert asks whether its conversation has open rows (conv_insert_requests:
others_open), and the rebuild and the reconciliation sweep read those rows
(rebuild_conversation_rows). ``ix_message_conversation`` holds every row of a conversation, so
a long one was read whole for each; this partial index holds only the open ones (a request
waiting for responses, a response not yet delivered), by (process_id, receive_timestamp), and
each leaves it when it is closed.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0030"
down_revision: str | None = "0029"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_message_conversation_open",
        "message",
        ["process_id", "receive_timestamp"],
        postgresql_where=sa.text(
            "service_name = 'conversation'"
            " AND state IN ('WAITING_FOR_RES', 'IN_QUEUE', 'PARTLY_FAILED')"
        ),
    )


def downgrade() -> None:
    op.drop_index("ix_message_conversation_open", table_name="message")
