"""The import graph of the project's packages has no cycle, between packages or between files."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engines", "lyanna_kernels", "policies", "serve_app", "loadtest")
# Command-line tools that time kernels against the engine's reference functions (`python -m
# lyanna_kernels.bench`): no module imports them, so they stand outside the layering engines -> kernels.
KERNEL_BENCHMARKS = ("lyanna_kernels.bench", "lyanna_kernels.linear_bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Modules imported anywhere in a file (function bodies too), except under `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> nx.DiGraph:
    """Edges file -> file it imports, over the project's packages."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        for target in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            if target in files and target != module:
                graph.add_edge(module, target)
    return graph


def test_no_import_cycle_between_files():
    cycles = [c for c in nx.simple_cycles(import_graph()) if len(c) > 1]
    assert not cycles, f"import cycles between files: {cycles[:5]}"


@pytest.mark.parametrize("depth", [1, 2])
def test_no_import_cycle_between_packages(depth: int):
    """Neither top-level packages (engines, policies, ...) nor their subpackages import each other
    in a cycle; a package's __init__ counts as part of it."""
    files = import_graph()
    for tool in KERNEL_BENCHMARKS:
        assert not list(files.predecessors(tool)), f"{tool} is a command-line tool; nothing may import it"
    files.remove_nodes_from(KERNEL_BENCHMARKS)
    packages = nx.DiGraph()
    for a, b in files.edges:
        pa, pb = ".".join(a.split(".")[:depth]), ".".join(b.split(".")[:depth])
        if pa != pb:
            packages.add_edge(pa, pb)
    cycles = list(nx.simple_cycles(packages))
    assert not cycles, f"import cycles between packages: {cycles}"


def test_no_package_shadows_an_installed_distribution():
    """No top-level package of ours has the import name of another installed distribution: transformers 5.25
    imports Hugging Face's `kernels` when it finds one, and a folder of ours by that name would stand in for it."""
    owners = importlib.metadata.packages_distributions()
    for package in PACKAGES:
        others = {d for d in owners.get(package, []) if d.lower().replace("_", "-") != "lyanna-serve"}
        assert not others, f"top-level package {package!r} shadows the installed distribution(s) {sorted(others)}"
