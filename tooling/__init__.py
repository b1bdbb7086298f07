"""Demo and test tooling: the main job, a client sink, workloads, process control, synthetic
data and demo handlers. Nothing in the product packages (worker, beat, models, api, reports)
imports it; it imports the product like any user would."""
