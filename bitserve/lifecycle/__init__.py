"""Which models serve: files a model may be loaded from, loaded versions (slots), and the manager
that loads, swaps, drains, rolls back and unloads them. Hot-swap lives here, not in the frontend."""
