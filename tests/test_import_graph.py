"""The package's module graph: no import cycle of any length, layers one way, small modules and folders.

The graph counts every import in a module's body: at the top, inside functions, and under ``TYPE_CHECKING``
(they tie the design as much as top-level ones). An import that names a package (``from icsd_audit.train.config
import TrainConfig``) is an edge to that package's ``__init__``; the package's own imports are its edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "icsd_audit"
MAX_LINES = 600
MAX_MODULES_PER_FOLDER = 12

#: layer of each top-level part; an import may only point to the same or a lower layer
LAYERS = {
    "tokens": 0, "outputs": 0, "threads": 0, "version": 0, "paths": 0, "moved": 0, "parquet_io": 0, "lazy": 0, "data_schemas": 0,
    "alloc": 1, "stats": 1, "grads": 2, "dumps": 2, "audit": 3, "report": 4, "runs": 4, "envs": 4,
    "train": 5, "integrations": 6, "cli": 7,
}


def module_files() -> dict[str, Path]:
    """Dotted name -> file, for the package and the folders it installs from elsewhere (cli/, data_schemas/)."""
    out: dict[str, Path] = {}
    for base, dotted in ((PKG, ("icsd_audit",)), (ROOT / "cli", ("icsd_audit", "cli")),
                         (ROOT / "data_schemas", ("icsd_audit", "data_schemas"))):
        for p in base.rglob("*.py"):
            parts = dotted + p.relative_to(base).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _targets(node: ast.AST, name: str, path: Path) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
        # ``from pkg import module`` names the module (the package's __init__ runs first as for any import, an
        # edge this graph leaves out); ``from pkg import name`` names the package
        return [f"{base}.{a.name}" for a in node.names] + [base]
    return []


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported module of this project: first line}; ``from pkg import module`` names the module."""
    files = module_files()
    graph: dict[str, dict[str, int]] = {m: {} for m in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = _targets(node, name, path)
            if isinstance(node, ast.ImportFrom) and all(t in files for t in targets[:-1]):
                targets = targets[:-1]  # every name is a module of the package
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_the_graph_sees_imports_inside_functions_and_type_checking() -> None:
    g = import_graph()
    assert "icsd_audit.alloc.scores" in g["icsd_audit.alloc.permutation"]
    # function-level imports count: the CLI imports its library lazily
    assert "icsd_audit.train.config" in g["icsd_audit.cli.train"]
    # TYPE_CHECKING imports count: the package's lazy surface names its modules for type checkers
    assert "icsd_audit.alloc.variants" in g["icsd_audit"]


def test_no_import_cycle_of_any_length() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_imports_point_down_the_layers() -> None:
    up = [f"{a} -> {b} (line {ln})" for a, targets in import_graph().items() for b, ln in targets.items()
          if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]  # type: ignore[operator]
    assert not up, "imports running up the layers:\n" + "\n".join(up)


def test_no_private_name_imported_across_modules() -> None:
    files = module_files()
    bad = []
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("icsd_audit"):
                bad += [f"{name}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "\n".join(bad)


def test_modules_fit_one_sitting() -> None:
    long = {str(p.relative_to(ROOT)): n for p in module_files().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("folder", sorted({p.parent for p in PKG.rglob("*.py")}), ids=lambda p: str(p.relative_to(ROOT)))
def test_folders_stay_narrow(folder: Path) -> None:
    n = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
    assert n <= MAX_MODULES_PER_FOLDER, f"{folder.relative_to(ROOT)} holds {n} modules"


def test_every_lazy_export_of_the_trl_package_is_the_named_object_in_any_import_order() -> None:
    """A lazy name equal to a submodule's name would be replaced by that module once it is imported."""
    pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")
    code = ("import importlib, sys; import icsd_audit.integrations.trl as p; names = p._EXPORTS; "
            "[importlib.import_module(m) for m in set(names.values())]; "
            "exec('from icsd_audit.integrations.trl import ' + ', '.join(names)); "
            "bad = [n for n in names if type(eval(n)).__name__ == 'module']; print(bad); sys.exit(1 if bad else 0)")
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
