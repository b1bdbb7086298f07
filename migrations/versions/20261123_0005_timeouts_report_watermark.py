"""timeouts counted on the message; the report watermark

The timeout monitor counts a message's timeouts in ``message.timeout_count``, in the same
statement that takes the message back, so the retry-or-fail decision is atomic and survives
a Redis restart. ``report_watermark`` records how far each incremental report has read.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 13:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "message",
        sa.Column("timeout_count", sa.Integer(), server_default="0", nullable=False),
    )
    op.create_table(
        "report_watermark",
        sa.Column("name", sa.String(length=100), primary_key=True),
        sa.Column("read_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
    )


def downgrade() -> None:
    op.drop_table("report_watermark")
    op.drop_column("message", "timeout_count")
