"""Server plugins: typed hooks around every generation (base.py), run in order under a time budget and
isolated per request (chain.py), found through the `bitserve.plugins` entry points (registry.py); the
content filter ships here (content_filter.py)."""
