"""process ids searchable: ix_message_process replaces ix_message_conversation

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-06 16:30:00

A listing filters by ``process_id`` (``GET /messages?process_id=``, ``orderly messages list
--process-id``). ``ix_message_process`` indexes every row with a process id, by
(process_id, msg_timestamp, msg_id): a conversation's rows, which hold its id there, as
``ix_message_conversation`` did, and the store's messages that name a process. Rows without
one are not in it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0027"
down_revision: str | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_message_process",
        "message",
        ["process_id", "msg_timestamp", "msg_id"],
        postgresql_where=sa.text("process_id IS NOT NULL"),
    )
    op.drop_index("ix_message_conversation", table_name="message")


def downgrade() -> None:
    op.create_index(
        "ix_message_conversation",
        "message",
        ["process_id", "msg_timestamp", "msg_id"],
        postgresql_where=sa.text("service_name = 'conversation'"),
    )
    op.drop_index("ix_message_process", table_name="message")
