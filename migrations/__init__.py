"""orderly's Alembic migrations (installed as ``orderly.migrations``;
``orderly.worker.db.schema`` runs them)."""
