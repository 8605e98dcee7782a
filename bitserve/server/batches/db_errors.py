"""The batch database's errors, apart from database.py so that its backends (sqlite_db.py, postgres_db.py),
which database.open_database imports, need not import it back."""

from __future__ import annotations


class DatabaseUnavailable(RuntimeError):
    """The batch database cannot be opened (the reason is the message); the Batch API stays off."""


class DatabaseInUse(DatabaseUnavailable):
    """Another process holds the SQLite batch database's lock."""
