"""conversation responses record whether they are their request's final one

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 18:00:00

``message.response_last`` is the ``last`` flag of a conversation response (NULL for every
other message). Redis held it alone; the rebuild from PostgreSQL after a Redis loss
(``worker/rebuild.py``) needs it to know which delivery completes a request.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("message", sa.Column("response_last", sa.Boolean(), nullable=True))


def downgrade() -> None:
    op.drop_column("message", "response_last")
