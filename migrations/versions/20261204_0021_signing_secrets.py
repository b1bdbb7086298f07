"""signing secrets: the keys of outbound requests' signatures

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-04 09:00:00

``signing_secret``: one Standard Webhooks secret per destination (a channel by origin, a
PUSH subscription by id, a source system), made the first time a request goes there, and the
previous one while a rotation lets both count (until ``previous_until``).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "signing_secret",
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("secret", sa.String(100), nullable=False),
        sa.Column("previous", sa.String(100), nullable=True),
        sa.Column("previous_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("rotated_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "kind IN ('channel', 'subscription', 'source_system')",
            name=op.f("ck_signing_secret_kind"),
        ),
        sa.CheckConstraint(
            "(previous IS NULL) = (previous_until IS NULL)",
            name=op.f("ck_signing_secret_previous"),
        ),
        sa.PrimaryKeyConstraint("kind", "name", name=op.f("pk_signing_secret")),
    )


def downgrade() -> None:
    op.drop_table("signing_secret")
