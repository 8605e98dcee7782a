"""The repository's fixture scripts (scripts/*.py) as modules, for the tests that regenerate their
fixtures live or reuse their helpers. One loader for all of them (tests/ is on sys.path: its conftest)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py, run once and registered in sys.modules before it runs (a script's dataclasses
    look their module up there while they are made)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        if spec is None or spec.loader is None:
            raise ImportError(f"no script {name!r} in {SCRIPTS}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
