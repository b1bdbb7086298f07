"""late conversation responses: message.late_ms

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 12:00:00

``message.late_ms`` marks a conversation response (``service_name = 'conversation'``,
``operation_name = 'response'``) that was handed to its client after its request had expired
from the conversation's order (AURA_QUEUE_MANAGER_MESSAGE_TTL ran out before the response
came). Such a response takes its request's turn again at the end of the conversation, behind
later requests' responses (the seed's rule), and goes out with ``X-Orderly-Late: true``.

- NULL: not late (every other row, and a late response not handed over: it never reached
  the client, its state says why).
- A number (>= 0): late; milliseconds by which the response came after its request's
  MESSAGE_TTL, counted from the request's timestamp (``now - requestTimestamp -
  MESSAGE_TTL`` when the response arrived, 0 when that is negative).

Set once, when the delivery (2xx, or the 202 awaiting an ACK) is recorded; it is a record of
what happened and no input to ordering: rebuilding Redis from the rows needs nothing from it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("message", sa.Column("late_ms", sa.BigInteger(), nullable=True))
    op.create_index(
        "ix_message_late",
        "message",
        ["msg_id"],
        postgresql_where=sa.text("late_ms IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_message_late", table_name="message")
    op.drop_column("message", "late_ms")
