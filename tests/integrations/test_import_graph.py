"""No import circles among the integrations/ modules, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import icsd_audit.integrations as pkg

PKG = "icsd_audit.integrations"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The sibling modules ``path`` imports anywhere in its body (module level or inside functions)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .core import x / from . import core
                base = f"{PKG}.{base}" if base else PKG
            if base == PKG:
                out |= {a.name for a in node.names if a.name in modules}
            elif base.startswith(PKG + "."):
                out.add(base[len(PKG) + 1:].split(".")[0])
        elif isinstance(node, ast.Import):
            out |= {a.name[len(PKG) + 1:].split(".")[0] for a in node.names if a.name.startswith(PKG + ".")}
    return out & modules


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_cycle_finder_finds_the_circles_that_were_there():
    assert _cycle({"verl": {"verl_trainer", "core"}, "verl_trainer": {"verl", "core"}, "core": set()}) == [
        "verl", "verl_trainer", "verl"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_integration_modules_import_without_circles():
    root = Path(pkg.__file__).parent
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph = {m: _imports(root / f"{m}.py", modules) - {m} for m in modules}
    assert {"core", "verl", "verl_trainer", "verl_gigpo", "verl_loss", "verl_distill", "sdar", "trl"} <= modules
    assert "verl_loss" in graph["verl_trainer"] and "core" in graph["sdar"]  # the scan sees real edges
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph) or [])}"
    assert not any("verl" in graph[m] for m in modules), "only verl's plug-in loader imports the plug-in module"
