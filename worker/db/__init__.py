"""Storage: the engine, the named SQL queries (``sql/*.sql``), prepared statements on the hot
path, the canonical functions and triggers (``sql/functions.sql``) and the migrations."""
