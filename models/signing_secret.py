"""The ``signing_secret`` table: the keys orderly signs its outbound requests with (Standard
Webhooks signatures, orderly.client.webhooks), one per destination: a channel (by origin), a
PUSH subscription (by id) or a source system (confirmations, and its messages' external
calls)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import CheckConstraint, DateTime, String, func
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base

SIGNING_KINDS = ("channel", "subscription", "source_system")


class SigningSecret(Base):
    __tablename__ = "signing_secret"
    __table_args__ = (
        CheckConstraint("kind IN ('channel', 'subscription', 'source_system')", name="kind"),
        # a previous secret is valid until a time, and only with one
        CheckConstraint("(previous IS NULL) = (previous_until IS NULL)", name="previous"),
    )

    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    # whsec_<base64 of 32 random bytes>, made the first time a request goes to the destination
    secret: Mapped[str] = mapped_column(String(100))
    # after a rotation: the secret before, still signed with until previous_until
    previous: Mapped[str | None] = mapped_column(String(100))
    previous_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    rotated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
