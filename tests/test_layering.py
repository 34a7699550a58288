"""Imports point down (docs DESIGN §10) and no miles modules import each other in a circle.

Every module under miles/ is parsed with `ast` (nothing is imported, no Ray, no model), and
every import of a miles module counts: top level, inside a function, under TYPE_CHECKING.

    .venv/bin/pytest -q tests/test_layering.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "miles"

EVERYTHING = frozenset({"miles"})
ALLOWED: dict[str, frozenset[str]] = {
    "miles.utils": frozenset({"miles.utils"}),
    "miles.lora": frozenset({"miles.lora", "miles.utils"}),
    "miles.dashboard": frozenset({"miles.dashboard", "miles.utils"}),
    # The standalone dashboard over a finished run reads its registry file.
    "miles.dashboard.__main__": frozenset({"miles.dashboard", "miles.controller", "miles.utils"}),
    "miles.controller": frozenset({"miles.controller", "miles.dashboard", "miles.utils"}),
    "miles.backends": frozenset({"miles.backends", "miles.lora", "miles.utils"}),
    "miles.rollout": frozenset({"miles.rollout", "miles.lora", "miles.utils"}),
    "miles.recipes": frozenset({"miles.recipes", "miles.rollout", "miles.lora", "miles.utils"}),
    "miles.ray": frozenset({"miles.ray", "miles.controller", "miles.utils"}),
    "miles.main": EVERYTHING,
}
"""What the modules under each name may import (the longest name that covers a module rules it)."""


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def miles_imports(module: str, path: Path, modules: set[str]) -> set[str]:
    """The miles modules `module` imports anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name == "miles" or name.startswith("miles.")}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {module: miles_imports(module, path, set(files)) for module, path in files.items()}


def rule_of(module: str) -> str | None:
    if module == "miles":
        return "miles.utils"  # the package's `__init__`: a leaf like utils
    covering = [name for name in ALLOWED if module == name or module.startswith(name + ".")]
    return max(covering, key=len) if covering else None


def within(target: str, allowed: frozenset[str]) -> bool:
    return any(target == name or target.startswith(name + ".") for name in allowed)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        rule = rule_of(module)
        if rule is None:
            problems.append(f"{module}: no layer rule covers it (add its package to ALLOWED)")
            continue
        allowed = ALLOWED[rule]
        for target in sorted(targets):
            if not within(target, allowed):
                problems.append(f"{module} imports {target}: {rule} may import only {sorted(allowed)}")
    return problems


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(module: str) -> None:  # Tarjan; the graph is a few hundred modules deep at most
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1 or module in graph[module]:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_imports_point_down_the_layers():
    problems = layer_violations(import_graph())
    assert not problems, "imports against the layers (DESIGN §10):\n" + "\n".join(problems)


def test_no_miles_modules_import_each_other_in_a_circle():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles (move what both need into a module below them):\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize(("source", "module", "problem"), [
    ("from miles.controller.registry import AdapterRegistry\n", "miles.utils.bad", "miles.utils.bad imports"),
    ("def later():\n    from ..main import launch\n", "miles.controller.bad", "miles.controller.bad imports"),
])
def test_a_bad_import_is_named(tmp_path, source, module, problem):
    """The checks themselves: an upward import, even inside a function and relative, is caught."""
    path = tmp_path / "bad.py"
    path.write_text(source)
    graph = {module: miles_imports(module, path, set(module_files()))}
    assert any(line.startswith(problem) for line in layer_violations(graph))


def test_a_cycle_is_named_and_a_module_that_only_joins_it_is_not():
    graph = {"miles.utils.a": {"miles.utils.b"}, "miles.utils.b": {"miles.utils.c"}, "miles.utils.c": {"miles.utils.a"},
             "miles.utils.d": {"miles.utils.a"}}
    assert import_cycles(graph) == [["miles.utils.a", "miles.utils.b", "miles.utils.c"]]
