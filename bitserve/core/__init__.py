"""Scheduling core: requests, the waiting queue, the token-budget scheduler and the paged KV-cache
bookkeeping (block pool, prefix hashes). Plain Python: imports no torch, no runner, no engine.
"""
