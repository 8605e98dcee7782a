"""The one place CLI output is written (the rest of bitserve logs; it never prints)."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def emit_json(value: Any) -> None:
    emit(json.dumps(value, ensure_ascii=False, indent=2, default=str))


def emit_error(text: str) -> None:
    sys.stderr.write(f"error: {text}\n")
    sys.stderr.flush()


PROGRESS_BAR_WIDTH = 30


def emit_progress(label: str, fraction: float, *, done: bool = False) -> None:
    """A one-line progress bar on stderr, redrawn in place; `done` ends the line."""
    filled = int(PROGRESS_BAR_WIDTH * max(0.0, min(1.0, fraction)))
    bar = "#" * filled + "-" * (PROGRESS_BAR_WIDTH - filled)
    sys.stderr.write(f"\r[{bar}] {fraction * 100:5.1f}% {label[:60]:<60}" + ("\n" if done else ""))
    sys.stderr.flush()
