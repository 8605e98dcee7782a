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
