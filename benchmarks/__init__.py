"""The benchmark harness of the repository (not installed with slipstream): peer adapters, suite entries,
matrix specs and per-kernel tools. `slipstream bench matrix | suite` load it from a checkout."""
