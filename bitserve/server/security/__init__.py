"""The HTTP edge's security: API keys and JWT (who), scopes from the route table (what), per-principal
rate limits and token quotas (how much), CORS and IP rules (from where), and the hash-chained audit
log. Imports nothing below the server; no home-made crypto (hashlib, hmac, PyJWT, cryptography)."""
