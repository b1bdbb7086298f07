"""The ``api_key`` table: who may call orderly's HTTP API, and for what; ``channel_ack_secret``:
what the ACK tokens of each origin are signed with.

A key is shown once, when it is created; the table keeps its prefix (to find it) and the
SHA-256 of the whole token (to check it), never the token itself.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, DateTime, Index, String, func, text
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base

ACK_SECRET_SQL = (
    "replace(gen_random_uuid()::text, '-', '') || replace(gen_random_uuid()::text, '-', '')"
)


class ApiKey(Base):
    __tablename__ = "api_key"
    __table_args__ = (
        CheckConstraint("cardinality(scopes) >= 1", name="scopes"),
        # A name is one live key at a time; revoked keys keep theirs for the audit trail.
        Index(
            "uq_api_key_live_name", "name", unique=True, postgresql_where=text("revoked_at IS NULL")
        ),
    )

    key_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100))
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    scopes: Mapped[list[str]] = mapped_column(ARRAY(String(120)))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The objects the key may act on (worker.keys.Owns: source systems, origins,
    # subscriptions); NULL: every object, as every key made before ownership did.
    owns: Mapped[dict[str, list[str | int]] | None] = mapped_column(JSONB)


class ChannelAckSecret(Base):
    """The key of the ACK tokens handed to one origin's client with each response: two random
    UUIDs (244 random bits) made by PostgreSQL the first time a response goes to that origin;
    never shown."""

    __tablename__ = "channel_ack_secret"

    origin: Mapped[str] = mapped_column(String(100), primary_key=True)
    secret: Mapped[str] = mapped_column(String(64), server_default=text(ACK_SECRET_SQL))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
