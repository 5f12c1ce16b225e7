"""The package layout: what the core maths imports, cheap imports, the public surface (cycles: test_import_graph)."""

from __future__ import annotations

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


PUBLIC = {
    "__version__", "Tokens", "Weights", "allocate", "Allocation", "allocator_names", "trust_names", "AllocatorSettings", "AllocatorOptions",
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


def test_every_package_folder_is_installed() -> None:
    """pyproject.toml lists its packages by name: a new subpackage missing from the list is left out of a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in PKG.rglob("__init__.py")}
    assert on_disk - listed == set(), sorted(on_disk - listed)
