"""No import circle inside an environment package (issue 20: searchqa's data <-> kb).

The graph counts every ``from .x import`` / ``import icsd_audit.envs.<pkg>.x`` in a
module, at the top or inside a function, so a lazy import that closes a loop counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import icsd_audit.envs as envs_pkg

ROOT = Path(envs_pkg.__file__).resolve().parent


def _edges(pkg: Path) -> dict[str, set[str]]:
    mods = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    dotted = f"icsd_audit.envs.{pkg.name}."
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m in mods:
        for node in ast.walk(ast.parse((pkg / f"{m}.py").read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:
                    targets.append(node.module.split(".")[0])
                elif node.level == 1:
                    targets += [a.name for a in node.names]
                elif node.module and node.module.startswith(dotted):
                    targets.append(node.module[len(dotted):].split(".")[0])
            elif isinstance(node, ast.Import):
                targets += [a.name[len(dotted):].split(".")[0] for a in node.names if a.name.startswith(dotted)]
            graph[m] |= {t for t in targets if t in mods and t != m}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for nxt in sorted(graph[n]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_cycle_finder_sees_a_lazy_loop():
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("pkg", sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()))
def test_no_import_cycle_in_env_package(pkg):
    graph = _edges(ROOT / pkg)
    assert _cycle(graph) is None, f"import cycle in icsd_audit.envs.{pkg}: {_cycle(graph)}"
