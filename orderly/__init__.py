"""orderly: ordered delivery of messages between systems, on Celery workers, Redis and
PostgreSQL.

Everything installed lives under this one package: ``orderly.worker``, ``orderly.beat``,
``orderly.models``, ``orderly.api``, ``orderly.reports``, ``orderly.migrations`` and
``orderly.client``. Importing ``orderly`` alone loads nothing else.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("orderly")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0.0.0"
