"""what each API key may act on

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30 09:00:00

``api_key.owns`` names the objects a key may act on: source systems (messages, their
responses, operator calls), origins (conversations) and subscriptions (pull, acknowledge,
dead letters, logs). The keys that exist keep NULL: they act on every object, as before.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("api_key", sa.Column("owns", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("api_key", "owns")
