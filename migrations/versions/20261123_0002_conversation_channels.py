"""conversation channels: each origin's delivery URL and retry policy

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 07:04:08.348594
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "channel",
        sa.Column("origin", sa.String(length=100), nullable=False),
        sa.Column("url", sa.String(length=1000), nullable=False),
        sa.Column("delivery_delay_ms", sa.Integer(), nullable=False),
        sa.Column("multiplier", sa.Float(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("timeout_ms", sa.Integer(), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_channel_attempts")),
        sa.CheckConstraint("delivery_delay_ms >= 1", name=op.f("ck_channel_delay")),
        sa.CheckConstraint("multiplier >= 1", name=op.f("ck_channel_multiplier")),
        sa.CheckConstraint("timeout_ms >= 1", name=op.f("ck_channel_timeout")),
        sa.PrimaryKeyConstraint("origin", name=op.f("pk_channel")),
    )


def downgrade() -> None:
    op.drop_table("channel")
