"""``icsd audit figures`` and ``icsd audit report``: the paper's mechanism figures from token dumps."""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, List, Optional

import typer

from . import options as O
from .common import (audit_settings, check_backend, check_output_dir, handle_errors, set_threads, stderr_console,
                     thread_count)
from .apps import audit_app


def _common(
    paths: List[str], base: Optional[str], compare: Optional[str], settings: dict[str, Any],
    seed: Optional[int], resamples: int, confidence: float, grid: int, permutations: int, strata_bins: int = 10,
) -> Any:
    """Report options: SDAR against the deployed allocator with the dumps' settings, flags overriding them."""
    from icsd_audit.report.results import ReportOptions

    s = audit_settings(paths, flags={"allocator": "--compare"}, allocator=compare, **settings, seed=seed)
    return ReportOptions.deployed(*s.pair(base, compare), seed=0 if seed is None else seed, n_resamples=resamples,
                                  confidence_level=confidence, grid=grid, permutations=permutations,
                                  strata_bins=strata_bins)


@contextlib.contextmanager
def _cluster(backend: str, ray_address: Optional[str]) -> Iterator[None]:
    """``--backend ray``: the batches and then the bootstrap's work units on one cluster (docs/scale.md)."""
    if backend != "ray":
        yield
        return
    from icsd_audit.audit.ray_backend import ray_bootstrap

    with ray_bootstrap(ray_address, thread_count()):
        yield


@audit_app.command("figures")
@handle_errors
@O.allocator_options()
def figures(
    paths: List[str] = O.PATHS,
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (one file per figure and format)."),
    fmt: str = typer.Option("png", "--format", help="Comma-separated formats: png, pdf, svg."),
    dpi: int = typer.Option(300, help="Resolution of PNG output, in dots per inch."),
    base: Optional[str] = O.BASE, compare: Optional[str] = O.COMPARE, seed: Optional[int] = O.SEED_PERMUTATIONS,
    resamples: int = O.RESAMPLES, confidence: float = O.CONFIDENCE, grid: int = O.GRID,
    permutations: int = O.PERMUTATIONS,
    strata_bins: int = typer.Option(10, "--strata-bins", callback=O.NON_NEGATIVE,
                                    help="Quantile bins of the token strata (SPEC 11: by entropy, else log-prob; "
                                         "with the top-20 % split); 0 leaves the section out, and its bootstrap."),
    backend: str = O.BACKEND, ray_address: Optional[str] = O.RAY_ADDRESS,
    *, settings: dict[str, Any],
) -> None:
    """Render the mechanism figures (sign regions, landscape, share shift; gradient
    compatibility with a `grad` column; training dynamics with several steps).

    Example: icsd audit figures runs/dumps/ --out figs/ --format png,pdf
    """
    from icsd_audit.report.build import audit_dumps, write_figures
    from icsd_audit.report.results import figures_own

    check_backend(backend, ray_address)
    check_output_dir(out, paths, figures_own)
    set_threads()
    formats = [f.strip().lower() for f in fmt.split(",") if f.strip()]
    if not formats or any(f not in ("png", "pdf", "svg") for f in formats):
        raise ValueError(f"--format: choose from png, pdf, svg (got {fmt!r})")
    with _cluster(backend, ray_address):
        report = audit_dumps(paths, _common(paths, base, compare, settings, seed, resamples, confidence, grid,
                                            permutations, strata_bins),
                             workers=thread_count(), backend=backend, ray_address=ray_address)
    written = write_figures(report, out, formats, dpi=dpi)
    stderr_console().print(f"wrote {len(written)} figure files to [bold]{out}[/]: "
                           + ", ".join(p.name for p in written) + _not_shown(report), soft_wrap=True)


@audit_app.command("report")
@handle_errors
@O.allocator_options()
def report(
    paths: List[str] = O.PATHS,
    out: Path = typer.Option(..., "--out", "-o", help="Output directory for summary.json, summary.md, report.html."),
    base: Optional[str] = O.BASE, compare: Optional[str] = O.COMPARE, seed: Optional[int] = O.SEED_PERMUTATIONS,
    resamples: int = O.RESAMPLES, confidence: float = O.CONFIDENCE, grid: int = O.GRID,
    permutations: int = O.PERMUTATIONS,
    strata_bins: int = typer.Option(10, "--strata-bins", callback=O.NON_NEGATIVE,
                                    help="Quantile bins of the token strata (SPEC 11: by entropy, else log-prob; "
                                         "with the top-20 % split); 0 leaves the section out, and its bootstrap."),
    backend: str = O.BACKEND, ray_address: Optional[str] = O.RAY_ADDRESS,
    *, settings: dict[str, Any],
) -> None:
    """Compute every audit statistic and write summary.json, summary.md, a
    self-contained report.html (figures embedded, provenance from the dump
    metadata) and figures/*.png.

    Example: icsd audit report runs/dumps/ --out audit/ --compare icsd --resamples 10000
    """
    from icsd_audit.report.build import audit_dumps, write_report
    from icsd_audit.report.results import report_owns

    check_backend(backend, ray_address)
    check_output_dir(out, paths, report_owns)
    set_threads()
    # the figures' modules (matplotlib: about 0.4 s) load on the core the first pass leaves idle
    figures = threading.Thread(target=importlib.import_module, args=("icsd_audit.report.render",), daemon=True)
    figures.start()
    with _cluster(backend, ray_address):
        rep = audit_dumps(paths, _common(paths, base, compare, settings, seed, resamples, confidence, grid,
                                         permutations, strata_bins),
                          workers=thread_count(), backend=backend, ray_address=ray_address)
    figures.join()
    write_report(rep, out)
    from icsd_audit.report.render import terminal_lines

    for line in terminal_lines(rep, out):
        print(line, file=sys.stderr)


def _not_shown(rep: Any) -> str:
    """``; not shown: section (reason), ...`` for the sections the data cannot support ('' when none)."""
    return "".join(f"; not shown: {name} ({why})" for name, why in rep.omitted.items())
