"""a worker's death counts against the message it was running: message.lone_claim, isolate

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-06 19:20:00

``lone_claim``: the claim that holds (or last held) the message took it alone. A worker that
dies holding a claim of several messages cannot say which of them it was running, so the
death counts against none of them: they go back with ``isolate`` set, and each is claimed
alone from then on, where a death does count (towards ORDERLY_WORKER_LOST_LIMIT). Both are
false for every row there is; adding them rewrites nothing (a constant default).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0028"
down_revision: str | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for column in ("lone_claim", "isolate"):
        op.add_column(
            "message",
            sa.Column(column, sa.Boolean(), nullable=False, server_default=sa.false()),
        )


def downgrade() -> None:
    for column in ("isolate", "lone_claim"):
        op.drop_column("message", column)
