"""a publish may carry an idempotency key

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 12:00:00

``event.idempotency_key``: a producer that retries a publish (after a reset, a timeout, a 503
whose outcome it cannot know) sends the same key and gets the event stored the first time,
not a second one. Unique per room.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("event", sa.Column("idempotency_key", sa.String(200), nullable=True))
    op.create_index(
        "ux_event_idempotency_key",
        "event",
        ["room_id", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ux_event_idempotency_key", table_name="event")
    op.drop_column("event", "idempotency_key")
