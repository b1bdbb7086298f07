"""orderly's Alembic migrations (installed as ``orderly.migrations``;
``orderly.worker.store.schema`` runs them)."""
