"""``icsd audit coeffs``: recompute g, u, m, c for every token of a dump."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from . import options as O
from .common import check_output_file, handle_errors, set_threads, stderr_console
from .apps import audit_app


@audit_app.command("coeffs")
@handle_errors
def coeffs(
    paths: List[Path] = O.PATHS,
    out: Path = typer.Option(..., "--out", "-o", help="Output Parquet file (written atomically)."),
    allocator: str = O.ALLOCATOR,
    trust: str = O.TRUST,
    trust_beta: float = O.TRUST_BETA,
    min_group: int = O.MIN_GROUP,
    eps: float = O.EPS,
    seed: int = O.SEED,
) -> None:
    """Write every input column plus g, u, m, c (float64) and fallback, in input row order.

    Example: icsd audit coeffs runs/dumps/ --out coeffs.parquet --allocator icsd
    """
    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.dumps.coeffs import compute_coefficients

    check_output_file(out, paths)
    set_threads()
    opts = AllocatorOptions(allocator=allocator, trust=trust, trust_beta=trust_beta, min_group=min_group, eps=eps, seed=seed)
    s = compute_coefficients(paths, out, opts)
    stderr_console().print(
        f"[bold]{out}[/]: {s.n_rows:,} rows, {s.n_tokens:,} valid tokens, {s.n_batches} batches, "
        f"{s.n_turns:,} turns; fallback share {s.fallback_share:.2%}; "
        f"sum c / sum g = {s.sum_c / s.sum_g if s.sum_g else float('nan'):.12f}; "
        f"max per-turn mass error {s.max_turn_mass_error:.1e}"
    )
