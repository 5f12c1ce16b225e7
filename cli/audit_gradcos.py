"""``icsd audit gradcos``: cosine between distillation and RL gradients, with permutation controls."""

from __future__ import annotations

import json
import sys
from typing import Any, List, Optional

import typer

from . import options as O
from .common import audit_settings, check_backend, handle_errors, set_threads, thread_count
from .apps import audit_app


@audit_app.command("gradcos")
@handle_errors
@O.allocator_options()
def gradcos(
    paths: List[str] = typer.Argument(..., help="Token dumps with a 'grad' column or sketch.<layer>.out/.in columns.",
                                       readable=False),
    base: Optional[str] = O.BASE,
    compare: Optional[str] = O.COMPARE,
    permutations: int = O.PERMUTATIONS,
    resamples: int = O.RESAMPLES,
    confidence: float = O.CONFIDENCE,
    seed: Optional[int] = O.SEED_PERMUTATIONS,
    blocks: int = typer.Option(8, help="Jackknife blocks for the sketch's own error (0: skip)."),
    clip_eps: float = O.CLIP_EPS,
    dual_clip: float = O.DUAL_CLIP,
    as_json: bool = O.JSON,
    backend: str = O.BACKEND,
    ray_address: Optional[str] = O.RAY_ADDRESS,
    *, settings: dict[str, Any],
) -> None:
    """Per-batch cos(RL direction, distillation direction) for base, compare and permuted controls.

    Example: icsd audit gradcos runs/dumps --permutations 1000 --json
    """
    from icsd_audit.audit.gradcos import run_gradcos

    if permutations < 0:
        raise ValueError(f"--permutations must be >= 0, got {permutations}")
    if blocks < 0:
        raise ValueError(f"--blocks must be >= 0 (0: skip the jackknife), got {blocks}")
    check_backend(backend, ray_address)
    set_threads()
    s = audit_settings(paths, flags={"allocator": "--compare"}, allocator=compare, **settings, seed=seed)
    base_opts, compare_opts = s.pair(base, compare)
    res = run_gradcos(paths, base=base_opts, compare=compare_opts, permutations=permutations,
                      seed=0 if seed is None else seed, n_resamples=resamples, confidence_level=confidence,
                      clip_eps=clip_eps, dual_clip=dual_clip, blocks=blocks, backend=backend, ray_address=ray_address,
                      workers=thread_count())
    payload = res.to_dict()
    if as_json:
        sys.stdout.write(json.dumps(payload, allow_nan=False) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    level = f"{100 * confidence:g} %"
    table = Table(title=f"icsd audit gradcos ({len(res.batch_ids)} batches, {res.n_permutations} permutations)",
                  caption=(f"Cosines (-1 to 1) and their differences; {level} batch-bootstrap CI over {resamples:,} "
                           "resamples; sketch s.e.: jackknife error of the random projection."),
                  caption_justify="left")
    for col in ("quantity", "estimate", f"{level} CI low", f"{level} CI high", "sketch s.e."):
        table.add_column(col, justify="left" if col == "quantity" else "right")
    err = res.sketch_error or {}
    for name in ("mean_base", "mean_compare", "mean_perm", "gain", "perm_gain", "pairing_gain"):
        r = getattr(res, name)
        if r is not None:
            se = err.get(name)
            table.add_row(name, f"{r.estimate:.4f}", f"{r.ci_low:.4f}", f"{r.ci_high:.4f}", "-" if se is None else f"{se:.4f}")
    if res.skipped:
        table.caption += (f" skipped {len(res.skipped)} batch{'es' if len(res.skipped) > 1 else ''} with an undefined "
                          "cosine: " + "; ".join(f"batch {b}: {r}" for b, r in res.skipped) + ".")
    Console().print(table)
