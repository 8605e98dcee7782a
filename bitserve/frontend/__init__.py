"""The asyncio-side of an engine (and the shared output processing used by the offline LLM)."""
