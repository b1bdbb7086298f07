"""orderly's Alembic migrations (installed as ``orderly_migrations``; worker.store.schema runs
them)."""
