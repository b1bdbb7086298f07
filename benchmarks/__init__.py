"""Benchmarks: each starts what it measures on local services and prints its figures."""

import os

# The benchmarks' sinks and stacks listen on loopback, which the outbound address policy
# refuses unless allowed: allowed explicitly (an operator's own setting wins).
os.environ.setdefault("ORDERLY_OUTBOUND_ALLOW", "127.0.0.1")
