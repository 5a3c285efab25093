"""Helpers for tests and measurement tools (hypothesis strategies, checkpoint builders); never
imported by the library itself."""
