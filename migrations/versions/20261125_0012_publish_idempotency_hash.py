"""a publish's idempotency key remembers the request it was given to

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 15:00:00

``event.idempotency_hash``: the SHA-256 of the publish that used the key. A repeat with the
same key and the same request answers the stored event; the same key with another request is
refused (a producer's mistake, not a retry).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("event", sa.Column("idempotency_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("event", "idempotency_hash")
