"""process ids searchable: ix_message_process

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-06 16:30:00

A listing filters by ``process_id`` (``GET /messages?process_id=``, ``orderly message list
--process-id``). ``ix_message_process`` indexes the store's messages that name a process, by
(process_id, msg_timestamp, msg_id); a conversation's rows, which hold its id there, stay in
``ix_message_conversation`` (the conversations' own queries keep an index of their rows only).
The listing asks both (messages_list).
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
        postgresql_where=sa.text("process_id IS NOT NULL AND service_name <> 'conversation'"),
    )


def downgrade() -> None:
    op.drop_index("ix_message_process", table_name="message")
