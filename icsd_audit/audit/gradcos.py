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

from icsd_audit.alloc.options import AllocatorOptions, required_columns, weight_pair
from icsd_audit.stats.bootstrap import BootstrapResult, batch_bootstrap_mean
from icsd_audit.stats.budget import GRADCOS_STATISTICS, check_bootstrap, check_resources
from icsd_audit.dumps.reader import DumpError, DumpReader, TokenBatch
from icsd_audit.grads.compat import cosines, factors_from_columns, jackknife_replicates, jackknife_se, rl_weights
from icsd_audit.alloc.permutation import permuted_coefficients
from icsd_audit.tokens import Tokens, Weights
from icsd_audit.audit.threads import single_threaded_maths

__all__ = ["GradcosSummary", "CosineRows", "batch_source", "batch_cosines", "summarize", "run_gradcos", "gradcos_part",
           "JACKKNIFE_MAX_PERM"]

#: permutations entering the jackknife (its cost grows with every weighting)
JACKKNIFE_MAX_PERM = 20


@dataclass(frozen=True)
class GradcosSummary:
    """SPEC 8 gradient compatibility per batch and batch-bootstrap means (``icsd audit gradcos --json``).

    ``cos_perm`` is the per-batch mean over ``n_permutations`` shuffles (None without a
    permutation control).  ``sketch_error`` holds jackknife standard errors of the
    across-batch means due to the random projection (None when not computed).
    ``skipped``: (batch id, reason) of batches whose cosine is undefined (no valid
    token, a zero RL or distillation direction); they enter no mean.
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
    skipped: tuple[tuple[int, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for i, b in enumerate(self.batch_ids):
            row = {"batch_id": int(b), f"cos_{self.base_name}": self.cos_base[i], f"cos_{self.compare_name}": self.cos_compare[i]}
            row["cos_perm"] = None if self.cos_perm is None else self.cos_perm[i]
            rows.append(row)
        out: dict[str, Any] = {"base": self.base_name, "compare": self.compare_name, "n_permutations": self.n_permutations,
                               "batches": rows}
        if self.skipped:  # (absent when none: outputs of complete runs are unchanged)
            out["n_skipped"] = len(self.skipped)
            out["skipped"] = [{"batch_id": int(b), "reason": r} for b, r in self.skipped]
        for k in ("mean_base", "mean_compare", "mean_perm", "gain", "perm_gain", "pairing_gain"):
            v = getattr(self, k)
            out[k] = None if v is None else v.to_dict()
        out["sketch_error"] = self.sketch_error
        return out


def batch_source(batch: TokenBatch, path: str | Path, *, paths: Sequence[str | Path] | None = None) -> Any:
    """The batch's gradient sketch: a dense (n, k) ``grad`` matrix or {layer: (U, V)} factors.

    Values are validated like every other column: a null, NaN or infinite entry is a
    :class:`DumpError` naming the file (from ``paths`` and the row's origin when given),
    the column and the row.
    """
    names = batch.table.column_names
    if "grad" in names:
        return _sketch_matrix(batch, "grad", path, paths).astype(np.float64)
    cols = {c: _sketch_matrix(batch, c, path, paths) for c in names if c.startswith("sketch.")}
    if not cols:
        raise DumpError(path, "no gradient sketch: need sketch.<layer>.out/.in columns (train with `icsd train "
                        "--sketch-k K`, e.g. 32) or a dense per-token 'grad' column written by any trainer "
                        "(docs/gradients.md)", column="grad")
    try:
        return factors_from_columns(cols)
    except ValueError as exc:  # an .out column without its .in, or the reverse
        raise DumpError(path, str(exc)) from None


def _sketch_matrix(batch: TokenBatch, name: str, path: str | Path, paths: Sequence[str | Path] | None) -> np.ndarray:
    """The (rows, k) matrix of a list column; a non-list type or rows of unequal length is a DumpError.

    The error names the file of the first row whose length differs from the batch's
    first row (from ``paths`` and the row's origin when given), the column and the row.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    col = batch.table.column(name).combine_chunks()
    if not (pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise DumpError(path, f"expected a fixed-size list of floats (a gradient sketch), got {col.type}", column=name)
    _check_list(batch, col, name, path, paths)
    n = len(col)
    if pa.types.is_fixed_size_list(col.type):
        k = col.type.list_size
    else:
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != lengths[0]) if n else np.empty(0, dtype=np.int64)
        if bad.size:
            row = int(bad[0])
            raise DumpError(paths[int(batch.file_index[row])] if paths is not None else path,
                            f"list of {lengths[row]} values where the batch's first row has {lengths[0]}; a gradient "
                            "sketch has one length for every row", column=name, row=int(batch.file_row[row]))
        k = int(lengths[0]) if n else 0
    return col.flatten().to_numpy(zero_copy_only=False).reshape(n, k)


def _check_list(batch: TokenBatch, col: Any, name: str, path: str | Path, paths: Sequence[str | Path] | None) -> None:
    """First null or non-finite entry of a list column, as a DumpError at its row."""
    import pyarrow as pa

    def fail(row: int, what: str) -> None:
        where = paths[int(batch.file_index[row])] if paths is not None else path
        raise DumpError(where, what, column=name, row=int(batch.file_row[row]))

    if col.null_count:
        fail(int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0]), "null value")
    values = col.flatten()
    if not pa.types.is_floating(values.type) and not pa.types.is_integer(values.type):
        raise DumpError(path, f"expected a list of floats, got {col.type}", column=name)
    flat = values.to_numpy(zero_copy_only=False)
    if values.null_count or (flat.dtype.kind == "f" and not np.isfinite(flat).all()):
        bad = np.flatnonzero(~np.isfinite(flat.astype(np.float64, copy=False)))[0]
        if isinstance(col, pa.FixedSizeListArray):
            row = int(bad // col.type.list_size)
        else:
            row = int(np.searchsorted(col.offsets.to_numpy()[1:], bad, side="right"))
        fail(row, "null value inside the list" if np.isnan(flat[bad]) and values.null_count else
             f"{'NaN' if np.isnan(flat[bad]) else 'infinite'} value")


def batch_cosines(tokens: Tokens, weights: Weights, source: Any, perm: np.ndarray | None, *,
                  clip_eps: float, dual_clip: float, blocks: int) -> tuple[np.ndarray, np.ndarray | None]:
    """([cos base, cos compare, mean cos perm], jackknife replicates (blocks, 3) or None)."""
    a, base, compare = tokens.numpy(), weights.base, weights.compare
    rl = rl_weights(torch.from_numpy(a.advantage), torch.from_numpy(a.ratio), torch.from_numpy(a.valid), clip_eps, dual_clip)
    top = float(rl.abs().max()) if rl.numel() else 0.0
    if top > 1e100 or not np.isfinite(top):
        # cosines ignore the scale of r; one huge advantage (1e300) would overflow |r|^2
        adv = a.advantage / np.abs(a.advantage[a.valid]).max()
        rl = rl_weights(torch.from_numpy(adv), torch.from_numpy(a.ratio), torch.from_numpy(a.valid), clip_eps, dual_clip)
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
              seed: int, skipped: Sequence[tuple[int, str]] = ()) -> GradcosSummary:
    """Batch-bootstrap means of the cosines and gains, with the jackknife sketch error.

    ``rows`` must hold defined cosines (see :class:`CosineRows`, which sets undefined
    batches aside as ``skipped``).
    """
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
        pairing_gain=res[5] if with_perm else None, sketch_error=err, skipped=tuple(skipped),
    )


def _why_undefined(tokens: Tokens, clip_eps: float, dual_clip: float) -> str:
    a = tokens.numpy()
    if not a.valid.any():
        return "no valid token"
    rl = rl_weights(torch.from_numpy(a.advantage), torch.from_numpy(a.ratio), torch.from_numpy(a.valid), clip_eps, dual_clip)
    if not bool(rl.ne(0).any()):
        if not (a.advantage[a.valid] != 0).any():
            return "zero RL direction (every advantage is 0)"
        return "zero RL direction (the clipped surrogate is flat at every token)"
    return "zero RL or distillation gradient (the sketch vanishes where the weights are nonzero)"


class CosineRows:
    """Per-batch cosines collected across a run; batches with an undefined cosine are set aside.

    A batch whose RL direction is zero (every advantage 0, as when all rollouts of
    its groups failed, common with sparse rewards), that has no valid token, or whose
    distillation direction vanishes has no cosine; it is recorded with the reason and
    enters no mean.  :meth:`summarize` fails only when no batch is left.
    """

    def __init__(self, *, with_perm: bool, clip_eps: float, dual_clip: float):
        self.with_perm, self.clip_eps, self.dual_clip = with_perm, clip_eps, dual_clip
        self.ids: list[int] = []
        self.rows: list[np.ndarray] = []
        self.jack: list[np.ndarray] = []
        self.skipped: list[tuple[int, str]] = []

    def add(self, batch_id: int, tokens: Tokens, cos: np.ndarray, jack: np.ndarray | None) -> None:
        if np.isfinite(cos[: 3 if self.with_perm else 2]).all():
            self.ids.append(int(batch_id))
            self.rows.append(cos)
            if jack is not None:
                self.jack.append(jack)
        else:
            self.skipped.append((int(batch_id), _why_undefined(tokens, self.clip_eps, self.dual_clip)))

    def merge(self, part: "CosineRows") -> None:
        """Append ``part``'s batches after these (what adding them here gives)."""
        self.ids.extend(part.ids)
        self.rows.extend(part.rows)
        self.jack.extend(part.jack)
        self.skipped.extend(part.skipped)

    def undefined(self) -> str | None:
        """Why no batch has a cosine (None when some batch has one)."""
        if self.rows:
            return None
        reasons = "; ".join(f"batch {b}: {r}" for b, r in self.skipped[:3])
        more = f"; and {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
        return f"gradient cosine undefined in every batch ({len(self.skipped)} skipped: {reasons}{more})"

    def summarize(self, **kw: Any) -> GradcosSummary:
        why = self.undefined()
        if why is not None:
            raise ValueError(why)
        return summarize(self.ids, self.rows, self.jack or None, skipped=self.skipped, **kw)


def permutation_matrix(tokens: Tokens, opts: AllocatorOptions, n: int, seed: int) -> np.ndarray:
    """(rows, n) coefficients of ``n`` seeded shuffles of the ICSD scores (seeds seed+1 ... seed+n)."""
    return permuted_coefficients(tokens, opts, seeds=[seed + 1 + p for p in range(n)]).numpy()


@dataclass(frozen=True)
class _Task:
    """What each batch's cosines need besides the batch."""

    base: AllocatorOptions
    compare: AllocatorOptions
    with_perm: bool
    permutations: int
    seed: int
    clip_eps: float
    dual_clip: float
    blocks: int

    def rows(self) -> CosineRows:
        return CosineRows(with_perm=self.with_perm, clip_eps=self.clip_eps, dual_clip=self.dual_clip)


def _add_batch(rows: CosineRows, reader: DumpReader, batch: TokenBatch, task: _Task) -> None:
    """One batch's cosines (and jackknife replicates) into ``rows``."""
    path = str(reader.paths[int(batch.file_index[0])])
    source = batch_source(batch, path, paths=reader.paths)
    weights, _ = weight_pair(batch.tokens, task.base, task.compare)
    perm = permutation_matrix(batch.tokens, task.compare, task.permutations, task.seed) if task.with_perm else None
    cos, j = batch_cosines(batch.tokens, weights, source, perm, clip_eps=task.clip_eps, dual_clip=task.dual_clip,
                           blocks=task.blocks)
    rows.add(batch.batch_id, batch.tokens, cos, j)


def gradcos_part(paths: Sequence[str], task: _Task, batch_id: int) -> CosineRows:
    """One batch's cosines, read by this process (what a Ray task runs)."""
    import warnings

    from icsd_audit.audit.ray_backend import worker_reader
    from icsd_audit.audit.threads import one_intra_op_thread

    reader = worker_reader(paths, None, tuple(required_columns(task.base.allocator, task.compare.allocator)))
    rows = task.rows()
    with one_intra_op_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the driver has shown them
        _add_batch(rows, reader, reader.batch(batch_id), task)
    return rows


@single_threaded_maths
def run_gradcos(paths: Sequence[str | Path], *, base: AllocatorOptions | None = None,
                compare: AllocatorOptions | None = None, permutations: int = 20, seed: int = 0,
                n_resamples: int = 10_000, confidence_level: float = 0.95, clip_eps: float = 0.2,
                dual_clip: float = 3.0, blocks: int = 8, backend: str = "local", ray_address: str | None = None,
                workers: int = 1) -> GradcosSummary:
    """Stream the dumps and compute the SPEC 8 compatibility summary.

    The permutation control shuffles ICSD's calibrated scores (SPEC 5 ``permuted``),
    so it runs when ``compare`` is ``icsd``; other compare allocators get none.
    ``base`` / ``compare`` left ``None``: SDAR and the deployed allocator, with the
    settings the dumps record (SPEC 9).  ``backend="ray"``: each batch's cosines computed
    by a Ray task (:mod:`icsd_audit.audit.ray_backend`; ``ray_address``: the cluster,
    default a local one of ``workers`` CPUs), collected here in batch order: the same result.
    """
    from icsd_audit.audit.run import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if base is None or compare is None:
        from icsd_audit.audit.settings import audit_settings

        b, c = audit_settings(paths).pair()
        base, compare = base or b, compare or c
    if permutations < 0:
        raise ValueError(f"permutations must be >= 0, got {permutations}")
    if blocks < 0:
        raise ValueError(f"blocks must be >= 0 (0: no jackknife), got {blocks}")
    check_bootstrap(n_resamples, GRADCOS_STATISTICS)
    reader = DumpReader(paths, columns=None, require=required_columns(base.allocator, compare.allocator))
    with_perm = compare.allocator == "icsd" and permutations > 0
    check_resources(reader, workers=1, permutations=permutations if with_perm else 0, n_resamples=n_resamples)
    task = _Task(base=base, compare=compare, with_perm=with_perm, permutations=permutations, seed=seed,
                 clip_eps=clip_eps, dual_clip=dual_clip, blocks=blocks)
    rows = task.rows()
    if backend == "ray":
        from icsd_audit.audit.ray_backend import ray_parts

        for part in ray_parts(gradcos_part, paths, (task,), reader.batch_ids, address=ray_address, workers=workers):
            rows.merge(part)
    else:
        for batch in reader:
            _add_batch(rows, reader, batch, task)
    return rows.summarize(base_name=base.allocator, compare_name=compare.allocator,
                          n_permutations=permutations if with_perm else 0, n_resamples=n_resamples,
                          confidence_level=confidence_level, seed=seed)
