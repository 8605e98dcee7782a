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
    too_long = {
        str(p.relative_to(PACKAGE)): n
        for p in python_files()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES
    }
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


def package_of(module: str) -> str:
    """bitserve.server.app -> server; bitserve.config -> config (a root module is its own node)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_imports(package: str) -> dict[str, set[str]]:
    """File (relative to the package) -> the bitserve modules and third-party roots it imports."""
    files = (PACKAGE / package).rglob("*.py") if (PACKAGE / package).is_dir() else [PACKAGE / f"{package}.py"]
    return {
        str(path.relative_to(PACKAGE)): imported_modules(path)
        for path in files
        if "__pycache__" not in path.parts
    }


# The import matrix (architecture note, section 2): who must not import whom. A forbidden entry is a
# bitserve package (bitserve.<name>) or a third-party root module.
FORBIDDEN_IMPORTS = {
    "server": {"core", "layers", "kernels", "runner", "models", "loader", "torch", "numpy", "numba"},
    "frontend": {"server", "cli", "core", "layers", "kernels", "runner", "models", "torch"},
    "lifecycle": {"server", "cli", "core", "layers", "kernels", "runner", "models", "torch"},
    "engine": {"server", "cli", "frontend", "lifecycle"},
    "core": {
        "engine",
        "runner",
        "models",
        "layers",
        "kernels",
        "loader",
        "frontend",
        "lifecycle",
        "server",
        "cli",
        "torch",
        "numpy",
    },
    "runner": {"engine", "frontend", "lifecycle", "server", "cli"},
    "models": {"runner", "engine", "frontend", "lifecycle", "server", "cli", "loader"},
    "layers": {"models", "runner", "engine", "frontend", "lifecycle", "server", "cli", "loader"},
    "kernels": {"layers", "models", "runner", "engine", "frontend", "lifecycle", "server", "cli", "loader"},
    "loader": {"runner", "engine", "frontend", "lifecycle", "server", "cli"},
    # structured output: guides (torch-free, for the server and SamplingParams) and the runner's masks
    "structured": {"runner", "engine", "frontend", "lifecycle", "server", "cli"},
    "tokenizer": {
        "models",
        "layers",
        "kernels",
        "runner",
        "engine",
        "frontend",
        "lifecycle",
        "server",
        "cli",
        "torch",
    },
    # the client talks HTTP only: importing it must not pull the server, the engine or torch
    "client": {
        "server",
        "cli",
        "frontend",
        "lifecycle",
        "engine",
        "core",
        "runner",
        "models",
        "layers",
        "kernels",
        "loader",
        "tokenizer",
        "metrics",
        "structured",
        "torch",
        "numpy",
    },
    "metrics": {
        "server",
        "frontend",
        "lifecycle",
        "engine",
        "runner",
        "models",
        "layers",
        "kernels",
        "torch",
    },
}
# Torch-free seam modules the server may use although their package is below it.
SEAM_MODULES = {"bitserve.engine.messages"}


def _offences(package: str, forbidden: set[str]) -> list[str]:
    found = []
    for file, modules in package_imports(package).items():
        for module in modules - SEAM_MODULES:
            target = package_of(module) if module.startswith("bitserve.") else module.split(".")[0]
            if target in forbidden:
                found.append(f"{file} imports {module}")
    return found


def test_import_matrix() -> None:
    offences = [
        line for package, forbidden in FORBIDDEN_IMPORTS.items() for line in _offences(package, forbidden)
    ]
    assert not offences, "imports against the architecture's direction:\n" + "\n".join(sorted(offences))


def test_only_the_metrics_module_imports_prometheus_client() -> None:
    offenders = [
        p.name
        for p in python_files()
        if "prometheus_client" in imported_modules(p) and p != PACKAGE / "metrics" / "prometheus.py"
    ]
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
    from bitserve.models.architectures import ARCHITECTURES

    assert set(ARCHITECTURES) == set(ARCHITECTURE_TRAITS)
