"""The tree keeps the architecture's shape: size ceilings, and imports that point one way."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bitserve"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


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


def test_every_registered_architecture_is_a_recipe() -> None:
    from bitserve.loader.model_spec import SUPPORTED_ARCHITECTURES
    from bitserve.models.architectures import ARCHITECTURES
    from bitserve.models.recipe import ArchitectureRecipe

    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHITECTURES)
    assert all(isinstance(recipe, ArchitectureRecipe) for recipe in ARCHITECTURES.values())


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the bitserve modules it imports anywhere in its file (deferred and TYPE_CHECKING imports
    included); `from package import name` counts as importing package.name where that is a module, else
    as importing package."""
    modules = {module_name(path): path for path in python_files()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (a list of modules, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


BACKEND_NAMES = {"reference", "cpu", "cuda"}
BACKEND_PACKAGES = tuple(f"bitserve.kernels.{name}" for name in BACKEND_NAMES)


def backend_branches(path: Path, root: Path = PACKAGE) -> list[str]:
    """Where a file tests a backend's name (`x.name == "cpu"`) or a weight's class (isinstance / type()
    against a class of a backend's package: kernels/reference, cpu, cuda; the protocol's own types in
    kernels/backend.py and prepared_linear.py are the seam, not a backend)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kernel_classes = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(BACKEND_PACKAGES)
        for alias in node.names
        if alias.name[:1].isupper()
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
            if any(name in BACKEND_NAMES for name in names) and "name" in ast.unparse(node):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        if is_call and node.func.id in {"isinstance", "type"}:
            if any(isinstance(a, ast.Name) and a.id in kernel_classes for a in ast.walk(node)):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_models_and_layers_never_branch_on_a_backend_or_weight_class() -> None:
    offences = [
        line
        for package in ("models", "layers")
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for line in backend_branches(path)
    ]
    assert not offences, "model code branching on a backend:\n" + "\n".join(offences)


def test_the_backend_branch_check_sees_one(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from bitserve.kernels.cpu.prepared import Int8BlockLinear\n"
        "def f(backend, w):\n"
        "    return backend.name == 'cpu' or isinstance(w, Int8BlockLinear)\n",
        encoding="utf-8",
    )
    assert len(backend_branches(sample, root=tmp_path)) == 2


# Where bitserve may read the environment: settings (every BITSERVE_* knob), the package's import-time
# OpenMP default (it must be set before torch loads, and yields to an OMP_* / GOMP_* the user set), and
# the test helper that asks whether Triton's interpreter is on.
ENVIRONMENT_READERS = {"server/settings.py", "__init__.py", "testing/kernel_device.py"}


def environment_reads(path: Path, root: Path = PACKAGE) -> list[str]:
    """os.environ.get / os.getenv / os.environ[...] / `in os.environ` / os.environ.setdefault in a file
    (building a child's environment from {**os.environ} is not a read of a knob)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        text = None
        if isinstance(node, ast.Call) and ast.unparse(node.func) in {
            "os.environ.get",
            "os.getenv",
            "os.environ.setdefault",
        }:
            text = ast.unparse(node)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            text = ast.unparse(node)
        elif isinstance(node, ast.Compare) and any(ast.unparse(c) == "os.environ" for c in node.comparators):
            text = ast.unparse(node)
        if text is not None:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    return found


def test_only_settings_reads_the_environment() -> None:
    offences = [
        line
        for path in python_files()
        if str(path.relative_to(PACKAGE)) not in ENVIRONMENT_READERS
        for line in environment_reads(path)
    ]
    assert not offences, "environment read outside server/settings.py:\n" + "\n".join(offences)


def test_the_environment_check_sees_reads(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\n"
        "a = os.environ.get('X')\nb = os.environ['Y']\nc = 'Z' in os.environ\nd = os.getenv('W')\n"
        "child = {**os.environ, 'V': '1'}\n",
        encoding="utf-8",
    )
    assert len(environment_reads(sample, root=tmp_path)) == 4
