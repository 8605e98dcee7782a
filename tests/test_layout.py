"""The tree keeps the architecture's shape: size ceilings, and imports that point one way."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bitserve"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def python_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_files_stay_under_the_ceiling() -> None:
    too_long = {str(p.relative_to(PACKAGE)): n for p in python_files() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert not too_long, f"files over {MAX_FILE_LINES} lines: {too_long}"


def test_functions_stay_under_the_ceiling() -> None:
    too_long = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({length} lines)")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


def test_core_imports_no_torch_and_nothing_above_it() -> None:
    for path in (PACKAGE / "core").glob("*.py"):
        for module in imported_modules(path):
            assert not module.startswith("torch"), f"{path.name} imports {module}"
            for upper in ("bitserve.runner", "bitserve.engine", "bitserve.frontend", "bitserve.server", "bitserve.models"):
                assert not module.startswith(upper), f"core/{path.name} imports {module}"


def test_only_the_metrics_module_imports_prometheus_client() -> None:
    offenders = [p.name for p in python_files() if "prometheus_client" in imported_modules(p) and p != PACKAGE / "metrics" / "prometheus.py"]
    assert not offenders


def test_no_print_calls_in_the_package() -> None:
    offenders = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders


def test_every_registered_architecture_has_traits() -> None:
    from bitserve.loader.model_spec import ARCHITECTURE_TRAITS
    from bitserve.models.registry import ARCHITECTURES

    assert set(ARCHITECTURES) == set(ARCHITECTURE_TRAITS)
