"""Imports point one way: no cycles between bitserve's packages, none between the modules of kernels/.

The graph is built from the source (ast), every import statement counted, including those inside
functions: a deferred import hides a cycle from the interpreter, not from the design.
Run as a script (`python tests/test_import_cycles.py`) to print the cycles it finds.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bitserve"
PACKAGES = (
    "kernels",
    "loader",
    "models",
    "layers",
    "runner",
    "core",
    "engine",
    "frontend",
    "lifecycle",
    "server",
    "metrics",
    "tokenizer",
    "structured",
    "client",
    "cli",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module named by a (possibly relative) `from ... import` statement."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, known: set[str]) -> set[str]:
    """bitserve modules imported by `path`; `from pkg import mod` counts as an import of pkg.mod."""
    importer, is_package = module_name(path), path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = resolve(node, importer, is_package)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # unknown names dropped below
    return {name for name in found if name in known and name != importer}


def module_graph() -> dict[str, set[str]]:
    """bitserve module -> the bitserve modules it imports."""
    paths = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    known = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, known) for p in paths}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


def package_graph(modules: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """bitserve.<pkg> -> the other packages its modules import."""
    graph: dict[str, set[str]] = {name: set() for name in PACKAGES}
    for module, imported in modules.items():
        source = package_of(module)
        if source is not None:
            targets = {package_of(name) for name in imported} - {None, source}
            graph[source].update(p for p in targets if p is not None)
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def kernels_graph(modules: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    inside = {name for name in modules if name.startswith("bitserve.kernels")}
    return {name: {m for m in modules[name] if m in inside} for name in inside}


def test_no_cycles_between_packages() -> None:
    assert cycles(package_graph(module_graph())) == []


def test_no_cycles_between_kernel_modules() -> None:
    assert cycles(kernels_graph(module_graph())) == []


def test_the_checker_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


if __name__ == "__main__":
    graph = module_graph()
    found = {"packages": cycles(package_graph(graph)), "kernels modules": cycles(kernels_graph(graph))}
    for kind, components in found.items():
        for component in components:
            sys.stdout.write(f"{kind} cycle: {' <-> '.join(component)}\n")
    sys.exit(1 if any(found.values()) else 0)
