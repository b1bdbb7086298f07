"""Beat: the periodic agents (re-processing pool, repair, node watch) and their schedule."""
