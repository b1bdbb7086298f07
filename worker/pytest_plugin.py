"""pytest fixtures for handler authors (``pytest_plugins = ["orderly.worker.pytest_plugin"]``): the
store to run handlers against with :func:`orderly.worker.testing.run_handler`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine


@pytest.fixture
def orderly_engine() -> Iterator[Engine]:
    """The store of ORDERLY_DATABASE_URL (created and migrated if need be)."""
    from orderly.worker.db import schema
    from orderly.worker.db.db import engine_for
    from orderly.worker.settings import get_settings

    url = get_settings().database_url
    schema.create_database(url)
    schema.upgrade(url)
    engine = engine_for(url)
    yield engine
    engine.dispose()
