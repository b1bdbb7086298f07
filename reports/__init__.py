"""Reports and synthetic data over orderly's PostgreSQL store."""
