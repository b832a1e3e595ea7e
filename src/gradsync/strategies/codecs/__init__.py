"""Gradient codecs: pure torch (no Lightning), testable in isolation."""
