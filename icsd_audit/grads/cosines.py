"""Gradient compatibility over dumps (SPEC 8): the library behind ``icsd audit gradcos``.

Per batch: the RL direction (advantage x ratio, zero where the clipped surrogate is
flat), the distillation directions of the base and compare weightings and of P
permutation controls, all from the per-token gradient sketch in the dump (a dense
``grad`` column or Kronecker factors ``sketch.<layer>.out|in``).  Across batches:
batch-bootstrap CIs of the mean cosines and gains (one set of resamples, so the
pairing-specific gain is a paired difference), and next to them the sketch's own
error: a delete-one-block jackknife over the projection dimensions, applied to the
same across-batch means.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from icsd_audit.alloc.options import AllocatorOptions, weight_pair
from icsd_audit.stats.bootstrap import BootstrapResult, batch_bootstrap_mean
from icsd_audit.dumps.reader import DumpError, DumpReader, TokenBatch
from icsd_audit.grads.compat import cosines, factors_from_columns, jackknife_replicates, jackknife_se, rl_weights
from icsd_audit.alloc.permutation import permuted_coefficients
from icsd_audit.tokens import Tokens, Weights

__all__ = ["GradcosSummary", "batch_source", "batch_cosines", "summarize", "run_gradcos", "JACKKNIFE_MAX_PERM"]

#: permutations entering the jackknife (its cost grows with every weighting)
JACKKNIFE_MAX_PERM = 20


@dataclass(frozen=True)
class GradcosSummary:
    """SPEC 8 gradient compatibility per batch and batch-bootstrap means (issue 4's JSON).

    ``cos_perm`` is the per-batch mean over ``n_permutations`` shuffles (None without a
    permutation control).  ``sketch_error`` holds jackknife standard errors of the
    across-batch means due to the random projection (None when not computed).
    """

    base_name: str
    compare_name: str
    batch_ids: tuple[int, ...]
    cos_base: tuple[float, ...]
    cos_compare: tuple[float, ...]
    cos_perm: tuple[float, ...] | None
    n_permutations: int
    mean_base: BootstrapResult
    mean_compare: BootstrapResult
    mean_perm: BootstrapResult | None
    gain: BootstrapResult
    perm_gain: BootstrapResult | None
    pairing_gain: BootstrapResult | None
    sketch_error: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for i, b in enumerate(self.batch_ids):
            row = {"batch_id": int(b), f"cos_{self.base_name}": self.cos_base[i], f"cos_{self.compare_name}": self.cos_compare[i]}
            row["cos_perm"] = None if self.cos_perm is None else self.cos_perm[i]
            rows.append(row)
        out: dict[str, Any] = {"base": self.base_name, "compare": self.compare_name, "n_permutations": self.n_permutations,
                               "batches": rows}
        for k in ("mean_base", "mean_compare", "mean_perm", "gain", "perm_gain", "pairing_gain"):
            v = getattr(self, k)
            out[k] = None if v is None else v.to_dict()
        out["sketch_error"] = self.sketch_error
        return out


def batch_source(batch: TokenBatch, path: str | Path) -> Any:
    """The batch's gradient sketch: a dense (n, k) ``grad`` matrix or {layer: (U, V)} factors."""
    import pyarrow as pa

    names = batch.table.column_names
    if "grad" in names:
        col = batch.table.column("grad").combine_chunks()
        if not (pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type)):
            raise DumpError(path, f"expected a fixed-size list of floats, got {col.type}", column="grad")
        flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.float64)
        n = len(col)
        if n == 0 or flat.size % n:
            raise DumpError(path, "rows have unequal gradient sketch lengths", column="grad")
        return flat.reshape(n, flat.size // n)
    cols = {c: _fixed_list(batch, c) for c in names if c.startswith("sketch.")}
    if not cols:
        raise DumpError(path, "no gradient sketch: need a 'grad' column or sketch.<layer>.out/.in columns", column="grad")
    return factors_from_columns(cols)


def _fixed_list(batch: TokenBatch, name: str) -> np.ndarray:
    col = batch.table.column(name).combine_chunks()
    flat = col.flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(len(col), -1)


def batch_cosines(tokens: Tokens, weights: Weights, source: Any, perm: np.ndarray | None, *,
                  clip_eps: float, dual_clip: float, blocks: int) -> tuple[np.ndarray, np.ndarray | None]:
    """([cos base, cos compare, mean cos perm], jackknife replicates (blocks, 3) or None)."""
    a, base, compare = tokens.numpy(), weights.base, weights.compare
    rl = rl_weights(torch.from_numpy(a.advantage), torch.from_numpy(a.ratio), torch.from_numpy(a.valid), clip_eps, dual_clip)
    valid = a.valid.astype(np.float64)
    cols = [base * valid, compare * valid] + ([] if perm is None else list((perm * valid[:, None]).T))
    w = torch.from_numpy(np.column_stack(cols))
    cos = cosines(source, rl, w).numpy()
    out = np.array([cos[0], cos[1], cos[2:].mean() if perm is not None else np.nan])
    jack = None
    if blocks >= 2:
        keep = w[:, : 2 + (min(perm.shape[1], JACKKNIFE_MAX_PERM) if perm is not None else 0)]
        rep = jackknife_replicates(source, rl, keep, blocks=blocks).numpy()
        jack = np.column_stack([rep[:, 0], rep[:, 1], rep[:, 2:].mean(axis=1) if perm is not None else np.full(blocks, np.nan)])
    return out, jack


def summarize(batch_ids: Sequence[int], rows: Sequence[np.ndarray], jack: Sequence[np.ndarray] | None, *,
              base_name: str, compare_name: str, n_permutations: int, n_resamples: int, confidence_level: float,
              seed: int) -> GradcosSummary:
    """Batch-bootstrap means of the cosines and gains, with the jackknife sketch error."""
    m = np.vstack(rows)
    with_perm = n_permutations > 0
    bad = ~np.isfinite(m[:, : 3 if with_perm else 2]).all(axis=1)
    if bad.any():
        raise ValueError(f"batch {batch_ids[int(np.flatnonzero(bad)[0])]}: gradient cosine undefined "
                         "(zero RL or distillation direction)")
    gain = m[:, 1] - m[:, 0]
    cols = [m[:, 0], m[:, 1], gain]
    if with_perm:
        pg = m[:, 2] - m[:, 0]
        cols += [m[:, 2], pg, gain - pg]
    res = batch_bootstrap_mean(np.column_stack(cols), n_resamples=n_resamples, confidence_level=confidence_level, rng=seed)
    err = None
    if jack:
        j = np.stack(jack)  # (batches, blocks, 3): blocks align across batches (same projections)
        mean_gain = (j[:, :, 1] - j[:, :, 0]).mean(axis=0)
        err = {"blocks": int(j.shape[1]), "gain": float(jackknife_se(torch.from_numpy(mean_gain)))}
        if with_perm:
            mean_pg = (j[:, :, 2] - j[:, :, 0]).mean(axis=0)
            err["perm_gain"] = float(jackknife_se(torch.from_numpy(mean_pg)))
            err["pairing_gain"] = float(jackknife_se(torch.from_numpy(mean_gain - mean_pg)))
    return GradcosSummary(
        base_name=base_name, compare_name=compare_name, batch_ids=tuple(int(b) for b in batch_ids),
        cos_base=tuple(map(float, m[:, 0])), cos_compare=tuple(map(float, m[:, 1])),
        cos_perm=tuple(map(float, m[:, 2])) if with_perm else None, n_permutations=n_permutations,
        mean_base=res[0], mean_compare=res[1], gain=res[2],
        mean_perm=res[3] if with_perm else None, perm_gain=res[4] if with_perm else None,
        pairing_gain=res[5] if with_perm else None, sketch_error=err,
    )


def permutation_matrix(tokens: Tokens, opts: AllocatorOptions, n: int, seed: int) -> np.ndarray:
    """(rows, n) coefficients of ``n`` seeded shuffles of the ICSD scores (seeds seed+1 ... seed+n)."""
    return permuted_coefficients(
        tokens, seeds=[seed + 1 + p for p in range(n)], trust=opts.trust, trust_beta=opts.trust_beta, eps=opts.eps,
        min_group=opts.min_group,
    ).numpy()


def run_gradcos(paths: Sequence[str | Path], *, base: AllocatorOptions, compare: AllocatorOptions, permutations: int = 20,
                seed: int = 0, n_resamples: int = 10_000, confidence_level: float = 0.95, clip_eps: float = 0.2,
                dual_clip: float = 3.0, blocks: int = 8) -> GradcosSummary:
    """Stream the dumps and compute the SPEC 8 compatibility summary.

    The permutation control shuffles ICSD's calibrated scores (SPEC 5 ``permuted``),
    so it runs when ``compare`` is ``icsd``; other compare allocators get none.
    """
    reader = DumpReader(paths, columns=None)
    with_perm = compare.allocator == "icsd" and permutations > 0
    ids, rows, jack = [], [], []
    for batch in reader:
        path = str(reader.paths[int(batch.file_index[0])])
        source = batch_source(batch, path)
        weights, _ = weight_pair(batch.tokens, base, compare)
        perm = permutation_matrix(batch.tokens, compare, permutations, seed) if with_perm else None
        cos, j = batch_cosines(batch.tokens, weights, source, perm, clip_eps=clip_eps, dual_clip=dual_clip,
                               blocks=blocks)
        ids.append(batch.batch_id)
        rows.append(cos)
        if j is not None:
            jack.append(j)
    return summarize(ids, rows, jack or None, base_name=base.allocator, compare_name=compare.allocator,
                     n_permutations=permutations if with_perm else 0, n_resamples=n_resamples,
                     confidence_level=confidence_level, seed=seed)
