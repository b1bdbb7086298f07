"""The mechanisms every part of orderly shares, each written once: the clock, the retry
policy, due work and its ticker, leases with fencing tokens, outbound HTTP, the errors and
the Lua scripts. Nothing here imports Celery, FastAPI or Spark."""
