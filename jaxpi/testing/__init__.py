"""Helpers for tests and measurement tools: hypothesis strategies, checkpoint builders, the scripted
model (`scripted`), the demo-data generator (`demo_data`). Only the benchmarks (`jaxpi.bench`) and
the tests import them; nothing below them in the library does."""
