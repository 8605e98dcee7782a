"""The synchronous engine heartbeat (schedule → execute → update) and its message types.

No asyncio and no HTTP here; the frontend talks to the engine only through `messages.py`.
"""
