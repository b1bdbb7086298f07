"""API keys, and the secret each origin's ACK tokens are signed with

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 07:00:00

``api_key``: a name, the key's prefix and the SHA-256 of its token, scopes, an optional
expiry, revocation and last use. ``channel_ack_secret``: two random UUIDs (244 random bits)
per origin, made the first time a response goes there, the key of the ACK tokens orderly
hands to clients.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACK_SECRET_SQL = (
    "replace(gen_random_uuid()::text, '-', '') || replace(gen_random_uuid()::text, '-', '')"
)


def upgrade() -> None:
    op.create_table(
        "api_key",
        sa.Column("key_id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("prefix", sa.String(32), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("scopes", postgresql.ARRAY(sa.String(120)), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("cardinality(scopes) >= 1", name=op.f("ck_api_key_scopes")),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_api_key")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_key_prefix")),
    )
    op.create_index(
        "uq_api_key_live_name",
        "api_key",
        ["name"],
        unique=True,
        postgresql_where=sa.text("revoked_at IS NULL"),
    )
    op.create_table(
        "channel_ack_secret",
        sa.Column("origin", sa.String(100), nullable=False),
        sa.Column("secret", sa.String(64), server_default=sa.text(ACK_SECRET_SQL), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("origin", name=op.f("pk_channel_ack_secret")),
    )


def downgrade() -> None:
    op.drop_table("channel_ack_secret")
    op.drop_index("uq_api_key_live_name", table_name="api_key")
    op.drop_table("api_key")
