"""Tools that write synthetic models for tests, fixtures and benchmarks (never used when serving)."""
