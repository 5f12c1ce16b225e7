"""The package layout: dependency direction, no import circles, the public surface."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import icsd_audit

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "icsd_audit"
IO_AND_UI = ("pyarrow", "polars", "typer", "rich", "matplotlib", "transformers")


def _module_name(path: Path) -> str:
    if path.is_relative_to(ROOT / "cli"):
        parts = ("icsd_audit", "cli", *path.relative_to(ROOT / "cli").with_suffix("").parts)
    else:
        parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_modules() -> list[str]:
    """Every module of the core maths, found on disk so that a new one is covered without edits."""
    found = [p for sub in ("alloc", "stats") for p in sorted((PKG / sub).glob("*.py")) if p.name not in ("run.py", "strata_run.py")]
    found += [PKG / "grads" / "compat.py", PKG / "tokens.py", PKG / "__init__.py"]
    return [_module_name(p) for p in found]


def test_core_modules_import_no_io_or_cli_packages() -> None:
    mods = core_modules()
    assert "icsd_audit.alloc.variants" in mods and "icsd_audit.stats.bootstrap" in mods
    code = (
        f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\n"
        f"bad = [m for m in {IO_AND_UI!r} if m in sys.modules]\nassert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_icsd_audit_is_cheap() -> None:
    code = "import sys, icsd_audit; bad = [m for m in ('torch', 'numpy', 'pyarrow') if m in sys.modules]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_help_does_not_import_torch() -> None:
    code = "import sys; from icsd_audit.cli.main import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _module_imports(path: Path, name: str) -> set[str]:
    """Modules of this project imported at module level (function-level imports run later, never in a circle)."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` blocks never run
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in out if m.startswith("icsd_audit")}


def test_no_import_circles() -> None:
    files = [p for p in PKG.rglob("*.py")] + list((ROOT / "cli").glob("*.py"))
    graph = {_module_name(p): p for p in files}
    edges = {m: {d for d in _module_imports(p, m) if d in graph and d != m} for m, p in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    # the check itself must see real edges
    assert "icsd_audit.alloc.variants" in edges["icsd_audit.alloc.options"]
    assert "icsd_audit.cli.apps" in edges["icsd_audit.cli.audit_stats"]


PUBLIC = {
    "__version__", "Tokens", "Weights", "allocate", "Allocation", "allocator_names", "trust_names", "AllocatorOptions",
    "weight_pair", "permuted_coefficients", "read_dumps", "DumpReader", "DumpError", "DumpWriter", "compute_coefficients",
    "tcm", "quadrants", "quadrant_shares", "share_shift", "clip_exposure", "audit", "landscape", "AuditAccumulator",
    "LandscapeAccumulator", "run_gradcos", "audit_dumps", "write_report", "ReportOptions", "strata", "StrataResult",
    "StrataBin", "StrataAccumulator", "run_strata",
}


def test_public_surface_is_pinned() -> None:
    assert set(icsd_audit.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(icsd_audit, name) is not None, name
    from icsd_audit.stats.api import quadrants, tcm

    assert icsd_audit.tcm is tcm and icsd_audit.quadrant_shares is quadrants


def test_tests_mirror_the_package() -> None:
    for sub in ("alloc", "dumps", "stats", "grads", "report", "train", "envs"):
        assert (PKG / sub).is_dir() and (ROOT / "tests" / sub).is_dir(), sub
    prefixed = [p for p in PKG.rglob("*.py") if p.parent != PKG and p.stem.startswith(p.parent.name.rstrip("s"))]
    assert not prefixed, f"modules repeating their folder's name: {prefixed}"
