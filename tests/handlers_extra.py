"""A handler module the API knows and a worker may not (for the missing-handler test)."""

from __future__ import annotations

from orderly.worker.handlers import MessageContext, registry


@registry.register("extra", "onlyInApi")
def only_in_api(ctx: MessageContext) -> None:
    """Never runs in a worker that lacks this module."""
