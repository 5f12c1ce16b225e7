"""``icsd audit coeffs``: recompute g, u, m, c for every token of a dump."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from . import options as O
from .common import (audit_settings, check_backend, check_output_file, handle_errors, set_threads, stderr_console,
                     thread_count)
from .apps import audit_app


@audit_app.command("coeffs")
@handle_errors
@O.allocator_options()
def coeffs(
    paths: List[str] = O.PATHS,
    out: Path = typer.Option(..., "--out", "-o", help="Output Parquet file (written atomically)."),
    allocator: Optional[str] = O.ALLOCATOR,
    seed: Optional[int] = O.SEED_ALLOCATOR,
    backend: str = O.BACKEND,
    ray_address: Optional[str] = O.RAY_ADDRESS,
    *, settings: dict[str, Any],
) -> None:
    """Write every input column plus g, u, m, c (float64) and fallback, in input row order.

    The allocation is recomputed with the settings the dumps record as deployed (SPEC 9); a flag given replaces
    the recorded value and says so on one stderr line.

    Example: icsd audit coeffs runs/dumps/ --out coeffs.parquet
    """
    from icsd_audit.audit.coeffs import compute_coefficients

    check_backend(backend, ray_address)
    check_output_file(out, paths)
    set_threads()
    opts = audit_settings(paths, allocator=allocator, **settings, seed=seed).deployed
    s = compute_coefficients(paths, out, opts, backend=backend, ray_address=ray_address, workers=thread_count())
    stderr_console().print(
        f"[bold]{out}[/]: {s.n_rows:,} rows, {s.n_tokens:,} valid tokens, {s.n_batches} batches, "
        f"{s.n_turns:,} turns; fallback share {s.fallback_share:.2%}; "
        f"sum c / sum g = {s.sum_c / s.sum_g if s.sum_g else float('nan'):.12f}; "
        f"max per-turn mass error {s.max_turn_mass_error:.1e}"
    )
