"""The response cache: exact-match answers to deterministic requests (key.py), kept in memory and
optionally on disk (tiers.py) under a TTL (cache.py), replayed as a stream or a whole body
(streams.py)."""
