"""Cluster and batch bootstrap for pooled ratio statistics (SPEC section 7).

Every audit statistic of SPEC section 6 is a ratio of pooled sums, ``sum_t num_t / sum_t den_t``, so it depends on
the data only through per-cluster sums (one cluster = one action turn, or one batch).  The bootstrap therefore never
touches tokens: a resample is a vector of multiplicities over clusters and the resampled sums of all statistics at
once are ``counts (R x n) @ sums (n x K)``.

Two resampling units:

- ``unit="action-turn"`` (the default; TCM, quadrant shares, share shift): action turns are resampled with
  replacement *within each stratum* (batch), each stratum keeping its own number of turns.  The multiplicities of
  one stratum are exactly Multinomial(n_s, 1/n_s); they are drawn with a fast exact sampler (Poissonization with an
  exact correction, four resamples per 16-bit lookup; see :mod:`icsd_audit.stats.engine.resample` and
  ``docs/statistics.md``), processed in blocks of :data:`BLOCK` resamples, each block from its own child generator,
  so results do not depend on ``chunk_size`` (memory) nor on how many resamples share a chunk.  The counts are a
  function of the seed and the layout (stratum sizes) alone, and each statistic (:class:`RatioFamily`) is summed on
  its own: one interval per statistic, whatever else is bootstrapped beside it (SPEC 7).
- ``unit="batch"`` (gradient compatibility; optional for ratio statistics): whole strata are resampled with
  replacement (within each group).

Intervals are percentile intervals (NumPy's default linear interpolation between order statistics), with the
standard error the standard deviation of the bootstrap distribution (ddof=1), as in :func:`scipy.stats.bootstrap`.
A resample in which a ratio is undefined (0/0) is left out of that statistic's interval.  The interval always
contains the point estimate: in the rare tiny or degenerate samples where the percentile interval excludes it, the
near end is moved to the estimate.

Pure numpy/scipy, float64 throughout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence

import numpy as np

from icsd_audit.stats.budget import check_families
from icsd_audit.stats.pool import on_threads
from icsd_audit.stats.engine.segments import SegmentedFamily, segment_rows
from icsd_audit.stats.engine.resample import (
    BLOCK, Family, Layout, batch_resampled_sums, check_rng as _check_rng, family_sums, resampled_sums, stream_seed,
)

__all__ = ["BLOCK", "BootstrapResult", "RatioBootstrapResult", "cluster_bootstrap_ratio", "bootstrap_ratio_columns",
           "bootstrap_ratio_families", "RatioFamily", "batch_bootstrap_mean", "exact_zero_result", "resampled_sums"]

Unit = Literal["action-turn", "batch"]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class BootstrapResult:
    """One statistic with its bootstrap interval (cf. ``scipy.stats.BootstrapResult``)."""

    estimate: float
    ci_low: float
    ci_high: float
    standard_error: float
    n_resamples: int
    confidence_level: float
    method: str = "percentile"
    unit: str = "action-turn"

    @property
    def confidence_interval(self) -> tuple[float, float]:
        return (self.ci_low, self.ci_high)

    def to_dict(self) -> dict[str, Any]:
        return {
            "estimate": _json_float(self.estimate),
            "ci_low": _json_float(self.ci_low),
            "ci_high": _json_float(self.ci_high),
            "standard_error": _json_float(self.standard_error),
            "n_resamples": int(self.n_resamples),
            "confidence_level": float(self.confidence_level),
            "method": self.method,
            "unit": self.unit,
        }


def exact_zero_result(n_resamples: int, confidence_level: float, unit: str = "action-turn") -> BootstrapResult:
    """A statistic that is 0 by construction (estimate, interval and error all exactly 0)."""
    return BootstrapResult(0.0, 0.0, 0.0, 0.0, int(n_resamples), float(confidence_level), "percentile", unit)


@dataclass(frozen=True)
class RatioBootstrapResult:
    """Ratios ``sum num_j / sum den_j`` and their differences, per group.

    Arrays have shape ``(n_groups, n_statistics)``; the statistics are the ratios in input order followed by the
    requested differences.  ``n_valid`` counts, per statistic, the resamples in which it was defined.
    ``replicates`` (only when asked for) has shape ``(n_resamples, n_groups, n_statistics)``.
    """

    estimate: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    standard_error: np.ndarray
    n_valid: np.ndarray
    names: tuple[str, ...]
    groups: tuple[Any, ...]
    n_resamples: int
    confidence_level: float
    method: str = "percentile"
    unit: str = "action-turn"
    replicates: np.ndarray | None = field(default=None, repr=False, compare=False)

    def index(self, statistic: int | str) -> int:
        if isinstance(statistic, str):
            try:
                return self.names.index(statistic)
            except ValueError:
                raise KeyError(f"unknown statistic {statistic!r}; known: {', '.join(self.names)}") from None
        return int(statistic)

    def result(self, statistic: int | str, group: int = 0) -> BootstrapResult:
        """The :class:`BootstrapResult` of one statistic in one group (by position)."""
        j = self.index(statistic)
        return BootstrapResult(float(self.estimate[group, j]), float(self.ci_low[group, j]),
                               float(self.ci_high[group, j]), float(self.standard_error[group, j]),
                               self.n_resamples, self.confidence_level, self.method, self.unit)


def _json_float(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


# --------------------------------------------------------------------------- validation


def _check_options(n_resamples: Any, confidence_level: Any, unit: Any) -> tuple[int, float, str]:
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, (int, np.integer)) or n_resamples < 1:
        raise ValueError(f"n_resamples must be a positive integer, got {n_resamples!r}")
    try:
        cl = float(confidence_level)
    except (TypeError, ValueError):
        raise ValueError(f"confidence_level must be a number in (0, 1), got {confidence_level!r}") from None
    if not 0.0 < cl < 1.0:
        raise ValueError(f"confidence_level must be in (0, 1), got {confidence_level!r}")
    if unit not in ("action-turn", "batch"):
        raise ValueError(f"unit must be 'action-turn' or 'batch', got {unit!r}")
    return int(n_resamples), cl, str(unit)


def _check_chunk(chunk_size: Any) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    return int(chunk_size)


def _labels(x: Any, n: int, what: str) -> tuple[np.ndarray, tuple[Any, ...]]:
    """Dense codes 0..k-1 (in sorted order of the labels) and the label values."""
    if x is None:
        return np.zeros(n, dtype=np.int64), (0,)
    a = np.asarray(x)
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{what} must be 1-D with one entry per cluster ({n}), got shape {a.shape}")
    values, codes = np.unique(a, return_inverse=True)
    return codes.astype(np.int64).reshape(-1), tuple(v.item() if hasattr(v, "item") else v for v in values)


def _as_matrix(x: Any, what: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2:
        raise ValueError(f"{what} must be 1-D or 2-D (clusters x statistics), got {a.ndim}-D")
    if a.size and not (np.isfinite(a.min()) and np.isfinite(a.max())):  # (NaN propagates; no (n x k) temporary)
        raise ValueError(f"{what} contains NaN or infinite values")
    return a


# --------------------------------------------------------------------------- percentiles


def _summarize_block(flat: np.ndarray, est: np.ndarray, alpha: float) -> tuple[np.ndarray, ...]:
    """:func:`summarize_bootstrap` for a (R, M) block of columns (float64)."""
    r, m = flat.shape
    cols = np.arange(m)
    finite = np.isfinite(flat)
    n_valid = finite.sum(axis=0)
    srt = np.sort(np.where(finite, flat, np.inf), axis=0)  # undefined resamples sort last
    last = np.maximum(n_valid - 1, 0)

    def pct(q: float) -> np.ndarray:
        # NumPy's default ("linear") percentile over the n_valid defined values
        h = (n_valid - 1) * q
        lo = np.clip(np.floor(h).astype(np.int64), 0, max(r - 1, 0))
        hi = np.minimum(lo + 1, last)
        a, b = srt[lo, cols], srt[hi, cols]
        out = np.where(b == a, a, a + (h - lo) * (b - a))
        return np.where(n_valid > 0, out, np.nan)

    with np.errstate(invalid="ignore"):
        low, high = pct(alpha / 2), pct(1 - alpha / 2)
        mean = np.where(finite, flat, 0.0).sum(axis=0) / np.maximum(n_valid, 1)
        var = (np.where(finite, flat - mean, 0.0) ** 2).sum(axis=0) / np.maximum(n_valid - 1, 1)
        se = np.where(n_valid > 1, np.sqrt(var), np.nan)
        # a constant bootstrap distribution has an exact 0, not a rounding residue
        se = np.where((n_valid > 1) & (srt[0, :] == srt[last, cols]), 0.0, se)
    # the reported interval always contains the estimate
    ok = np.isfinite(est)
    low = np.where(ok & np.isfinite(low), np.minimum(low, est), np.where(ok, low, np.nan))
    high = np.where(ok & np.isfinite(high), np.maximum(high, est), np.where(ok, high, np.nan))
    return low, high, se, n_valid


def summarize_bootstrap(reps: np.ndarray, estimate: np.ndarray, confidence_level: float) -> tuple[np.ndarray, ...]:
    """Percentile interval, bootstrap standard error and defined-resample counts.

    ``reps`` has the resamples along axis 0; columns are summarized in blocks so a
    float32 replicate array is never copied whole to float64.
    """
    alpha = 1.0 - confidence_level
    r = reps.shape[0]
    shape = reps.shape[1:]
    flat = reps.reshape(r, -1)
    est = np.asarray(estimate, dtype=np.float64).reshape(-1)
    m = flat.shape[1]
    out = [np.empty(m), np.empty(m), np.empty(m), np.empty(m, dtype=np.int64)]
    step = max(1, (1 << 22) // max(r, 1))
    for c0 in range(0, m, step):
        c1 = min(m, c0 + step)
        part = _summarize_block(np.asarray(flat[:, c0:c1], dtype=np.float64), est[c0:c1], alpha)
        for o, p_ in zip(out, part):
            o[c0:c1] = p_
    return tuple(o.reshape(shape) for o in out)


# --------------------------------------------------------------------------- public API


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1.0), np.nan)


def cluster_bootstrap_ratio(
    numerators: Any,
    denominators: Any,
    *,
    strata: Any = None,
    groups: Any = None,
    differences: Sequence[tuple[int, int]] = (),
    names: Sequence[str] | None = None,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    unit: Unit = "action-turn",
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
    keep_replicates: bool = False,
) -> RatioBootstrapResult:
    """Bootstrap pooled ratio-of-sums statistics from per-cluster sums.

    Parameters
    ----------
    numerators, denominators
        Per-cluster sums, shape (n_clusters,) or (n_clusters, J): statistic j is
        ``sum numerators[:, j] / sum denominators[:, j]`` over the clusters of a group.
        A cluster is an action turn (SPEC 7); its sums are what the statistic adds up.
    strata
        Per-cluster stratum label (the batch); resampling never crosses a stratum.
        Default: one stratum.
    groups
        Per-cluster group label: every statistic is computed separately per group
        (e.g. per training step); groups are sorted by label.  Default: one group.
    differences
        Pairs (a, b) of ratio indices: the paired difference ratio_a - ratio_b,
        computed on the same resample.  They follow the ratios in the result.
    names
        Labels of the ratios then the differences (default r0, r1, ..., "r0-r1").
    unit
        ``"action-turn"``: resample clusters with replacement within each stratum;
        ``"batch"``: resample whole strata with replacement within each group.
    rng
        A :class:`numpy.random.Generator`, a seed, or None (fresh entropy).
    chunk_size
        Resamples whose statistics are computed per step (rounded down to a multiple
        of :data:`BLOCK`, default 1024); never changes the result.  Working memory
        is about 1 byte per cluster per block of 16 resamples in flight (plus a 512 KB tile per worker).
    workers
        Processes (threads where fork is unavailable) drawing blocks in parallel; never
        changes the result.
    keep_replicates
        Keep the (n_resamples, n_groups, n_statistics) bootstrap distribution.
    """
    num = _as_matrix(numerators, "numerators")
    den = _as_matrix(denominators, "denominators")
    if num.shape != den.shape:
        raise ValueError(f"numerators and denominators must have the same shape, got {num.shape} and {den.shape}")
    j = num.shape[1]
    cols, col_index = _dedupe_columns(np.concatenate([num, den], axis=1))
    return bootstrap_ratio_columns(
        cols,
        col_index[:j],
        col_index[j:],
        strata=strata,
        groups=groups,
        differences=differences,
        names=names,
        n_resamples=n_resamples,
        confidence_level=confidence_level,
        unit=unit,
        rng=rng,
        chunk_size=chunk_size,
        workers=workers,
        keep_replicates=keep_replicates,
    )


@dataclass(frozen=True, eq=False)
class RatioFamily:
    """One statistic's bootstrap request: ratios of per-cluster column sums (and their differences).

    ``sums`` (n_clusters x K) holds each per-cluster sum once; ratio j is ``sum sums[:, numerator_index[j]] / sum
    sums[:, denominator_index[j]]`` per group; ``strata`` / ``groups`` label the clusters (batch, and e.g. step);
    ``differences`` pairs (a, b) of ratio indices, ratio_a - ratio_b on the same resample; ``names`` label the ratios
    then the differences.  ``totals``: columns K, K + 1, ..., each the total of some of ``sums``' columns (its parts,
    e.g. the five sign regions of a turn's mass): its point and resampled sums are its parts' added in order, with no
    product of its own.  ``column_groups``, ``tied``: bins and (numerator, denominator) pairs
    (:mod:`icsd_audit.stats.engine.segments`).  ``donate``: the caller gives ``sums`` up (reads them no more), so
    the engine may reorder them in place rather than copy them.
    """

    sums: Any
    numerator_index: Sequence[int]
    denominator_index: Sequence[int]
    strata: Any = None
    groups: Any = None
    differences: Sequence[tuple[int, int]] = ()
    names: Sequence[str] | None = None
    totals: Sequence[Sequence[int]] = ()
    column_groups: Sequence[Sequence[int]] = ()
    tied: Sequence[tuple[int, int]] = ()
    donate: bool = False


@dataclass
class _Prepared:
    """A family sorted into its layout: clusters by (group, stratum), its columns, its point estimates."""

    ST: np.ndarray | None  # (used columns, clusters), clusters in layout order (None once the engine has it)
    num: np.ndarray
    den: np.ndarray
    diffs: list[tuple[int, int]]
    names: tuple[str, ...]
    sizes: np.ndarray
    sstarts: np.ndarray
    sgroup: np.ndarray
    gvalues: tuple[Any, ...]
    estimate: np.ndarray
    totals: tuple[tuple[int, ...], ...] = ()  # positions in ST of each total's parts
    segments: tuple[list[list[int]], list[tuple[int, int]]] | None = None  # column groups, tied pairs (ST rows)
    own: bool = False  # ST is no caller's array: the engine may reorder it in place

    def with_totals(self, T: np.ndarray) -> np.ndarray:
        """T's columns, then each total: its parts' sums added in order."""
        if not self.totals:
            return T
        extra = [functools.reduce(np.add, [T[..., c] for c in parts]) for parts in self.totals]
        return np.concatenate([T, np.stack(extra, axis=-1)], axis=-1)

    def stats_of(self, T: np.ndarray) -> np.ndarray:
        T = self.with_totals(T)
        r = _ratio(T[..., self.num], T[..., self.den])
        if self.diffs:
            d = np.stack([r[..., a] - r[..., b] for a, b in self.diffs], axis=-1)
            r = np.concatenate([r, d], axis=-1)
        return r


def _prepare(fam: RatioFamily, workers: int = 1) -> _Prepared:
    """Validate a family and lay it out; no copy of its sums when they come as rows (``M.T``) in order."""
    S0 = _as_matrix(fam.sums, "sums")
    n, k = S0.shape
    if n == 0:
        raise ValueError("no clusters to resample")
    num_idx = np.asarray(fam.numerator_index, dtype=np.int64).reshape(-1)
    den_idx = np.asarray(fam.denominator_index, dtype=np.int64).reshape(-1)
    if num_idx.shape != den_idx.shape:
        raise ValueError("numerator_index and denominator_index must have the same length")
    totals = [np.asarray(t, dtype=np.int64).reshape(-1) for t in fam.totals]
    if any(t.size == 0 or ((t < 0) | (t >= k)).any() for t in totals):
        raise ValueError(f"each total needs one or more parts among the columns 0..{k - 1}")
    kt = k + len(totals)  # totals are columns k, k + 1, ...
    if ((num_idx < 0) | (num_idx >= kt) | (den_idx < 0) | (den_idx >= kt)).any():
        raise ValueError(f"column indices must lie in 0..{kt - 1}")
    j = num_idx.size
    diffs = [(int(a), int(b)) for a, b in fam.differences]
    for a, b in diffs:
        if not (0 <= a < j and 0 <= b < j):
            raise ValueError(f"difference ({a}, {b}) refers to a ratio outside 0..{j - 1}")
    names = fam.names
    if names is None:
        names = tuple(f"r{i}" for i in range(j)) + tuple(f"r{a}-r{b}" for a, b in diffs)
    names = tuple(str(x) for x in names)
    if len(names) != j + len(diffs):
        raise ValueError(f"names must have {j + len(diffs)} entries (ratios then differences), got {len(names)}")
    scode, _ = _labels(fam.strata, n, "strata")
    gcode, gvalues = _labels(fam.groups, n, "groups")
    n_groups = len(gvalues)
    # only the columns some ratio or some used total needs, each once; the used totals' positions follow them
    ref = np.concatenate([num_idx, den_idx])
    used_totals = [i for i in range(len(totals)) if (ref == k + i).any()]
    used = np.unique(np.concatenate([ref[ref < k], *[totals[i] for i in used_totals]]))
    pos = {int(c): q for q, c in enumerate(used.tolist())}
    pos.update({k + i: used.size + q for q, i in enumerate(used_totals)})
    inv = np.array([pos[int(c)] for c in ref.tolist()], dtype=np.int64)
    parts = tuple(tuple(pos[int(c)] for c in totals[i].tolist()) for i in used_totals)
    # clusters by (group, stratum), stable: strata nested in groups, clusters in input order
    key = gcode * (int(scode.max()) + 1) + scode
    X = S0
    if (np.diff(key) < 0).any():
        order = np.lexsort((scode, gcode))
        key, X = key[order], S0[order]
    if used.size != k:
        X = X[:, used]
    ST = X.T if fam.donate and X.T.strides[1] == X.itemsize else np.ascontiguousarray(X.T)  # donated rows in place
    sstarts = np.concatenate([[0], np.flatnonzero(np.diff(key)) + 1]).astype(np.int64)
    sizes = np.diff(np.concatenate([sstarts, [n]]))
    g_sorted = key // (int(scode.max()) + 1)
    gbounds = np.concatenate([[0], np.flatnonzero(np.diff(g_sorted)) + 1, [n]])
    # point estimates: each column added row after row, in layout order (one running-sum buffer per thread)
    total = np.empty((n_groups, ST.shape[0]))
    longest = int(np.diff(gbounds).max())

    def add_up(cols: range) -> None:
        run = np.empty(longest)
        for g in range(n_groups):
            for c in cols:
                total[g, c] = np.cumsum(ST[c, gbounds[g] : gbounds[g + 1]], out=run[: gbounds[g + 1] - gbounds[g]])[-1]

    w = max(1, workers)
    on_threads(add_up, [range(i, ST.shape[0], w) for i in range(w)], w)
    prep = _Prepared(ST, inv[:j], inv[j:], diffs, names, sizes, sstarts, g_sorted[sstarts], gvalues, np.empty(0),
                     parts)
    prep.estimate = prep.stats_of(total)
    prep.own = bool(fam.donate) or not np.may_share_memory(ST, fam.sums)
    if (fam.column_groups or fam.tied) and n_groups == 1:
        prep.segments = segment_rows(fam.column_groups, fam.tied, {c: r for c, r in pos.items() if c < k}, used.size)
    return prep


def bootstrap_ratio_families(
    families: Iterable[RatioFamily],
    *,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    unit: Unit = "action-turn",
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
    keep_replicates: bool | Sequence[bool] = False,
    replicate_budget: int = 1 << 28,
) -> list[RatioBootstrapResult]:
    """Bootstrap several statistics, each from its own columns, on the resample stream of their layouts.

    The resamples of a family depend only on ``rng`` and its layout (the sizes of its strata, sorted by group then
    stratum), never on the other families: families with the same layout are computed from one draw of counts, and
    each one's values are the same bits as when it is bootstrapped alone (SPEC 7, one interval per statistic).
    ``rng`` is read once (an int seed always gives the same stream).  Options as in :func:`bootstrap_ratio_columns`;
    ``keep_replicates`` may be given per family.  A family's matrix is held here only while the engine needs it
    (not where the engine keeps copies, e.g. sparse parts): families handed over one by one (an iterator, no list
    of the caller's) let each matrix go during the bootstrap.
    """
    n_resamples, confidence_level, unit = _check_options(n_resamples, confidence_level, unit)
    chunk_size = _check_chunk(chunk_size)
    seed = stream_seed(rng)
    preps = [_prepare(f, workers) for f in families]
    check_families(n_resamples, [(len(p.gvalues), len(p.names)) for p in preps])  # one line, not a MemoryError
    reps = []
    for p in preps:
        n_stat = len(p.names)
        dtype = np.float64 if n_resamples * len(p.gvalues) * n_stat * 8 <= replicate_budget else np.float32
        reps.append(np.empty((n_resamples, len(p.gvalues), n_stat), dtype=dtype))
    if unit == "action-turn":
        layouts: dict[bytes, list[int]] = {}
        for i, p in enumerate(preps):
            layouts.setdefault(p.sizes.tobytes(), []).append(i)
        for idx in layouts.values():
            lay = Layout(preps[idx[0]].sizes)
            fams = [Family(preps[i].ST, preps[i].sgroup, len(preps[i].gvalues), lay) if preps[i].segments is None
                    else SegmentedFamily(preps[i].ST, *preps[i].segments, lay, workers=workers, own=preps[i].own)
                    for i in idx]
            for i in idx:  # what the engine needs it holds; the rest may go
                preps[i].ST = None
            for r0, r1, Ts in family_sums(lay, fams, n_resamples, seed=seed, chunk_size=chunk_size, workers=workers):
                for i, T in zip(idx, Ts):
                    reps[i][r0:r1] = preps[i].stats_of(T)
    else:
        for i, p in enumerate(preps):
            # each family's batch multiplicities from the same child stream: a function of the layout only
            gen = np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed.entropy, spawn_key=(2**32,))))
            bsums = np.add.reduceat(p.ST, p.sstarts, axis=1).T
            for r0, r1, T in batch_resampled_sums(bsums, p.sgroup, len(p.gvalues), n_resamples, gen,
                                                  chunk_size=chunk_size or 1024):
                reps[i][r0:r1] = p.stats_of(T)
    keep = [bool(keep_replicates)] * len(preps) if isinstance(keep_replicates, (bool, np.bool_)) else list(keep_replicates)
    out = []
    for p, rep, kept in zip(preps, reps, keep):
        low, high, se, n_valid = summarize_bootstrap(rep, p.estimate, confidence_level)
        out.append(RatioBootstrapResult(
            estimate=p.estimate, ci_low=low, ci_high=high, standard_error=se, n_valid=n_valid, names=p.names,
            groups=p.gvalues, n_resamples=n_resamples, confidence_level=confidence_level, unit=unit,
            replicates=rep if kept else None,
        ))
    return out


def bootstrap_ratio_columns(
    sums: Any,
    numerator_index: Sequence[int],
    denominator_index: Sequence[int],
    *,
    strata: Any = None,
    groups: Any = None,
    differences: Sequence[tuple[int, int]] = (),
    names: Sequence[str] | None = None,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    unit: Unit = "action-turn",
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
    keep_replicates: bool = False,
    replicate_budget: int = 1 << 28,
) -> RatioBootstrapResult:
    """:func:`cluster_bootstrap_ratio` on a shared column table.

    ``sums`` (n_clusters x K) holds each per-cluster sum once; ratio j is ``sum sums[:, numerator_index[j]] / sum
    sums[:, denominator_index[j]]``.  Ratios sharing a column resample it once, and a difference of two ratios built
    from the same columns is exactly 0 on every resample.  Replicates are kept as float64 unless they would exceed
    ``replicate_budget`` bytes (then float32).
    """
    fam = RatioFamily(sums, numerator_index, denominator_index, strata=strata, groups=groups,
                      differences=differences, names=names)
    return bootstrap_ratio_families([fam], n_resamples=n_resamples, confidence_level=confidence_level, unit=unit,
                                    rng=rng, chunk_size=chunk_size, workers=workers, keep_replicates=keep_replicates,
                                    replicate_budget=replicate_budget)[0]


def _dedupe_columns(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bitwise-distinct columns of ``m`` and, per input column, its index among them."""
    seen: dict[bytes, int] = {}
    keep: list[int] = []
    index = np.empty(m.shape[1], dtype=np.int64)
    for c in range(m.shape[1]):
        key = np.ascontiguousarray(m[:, c]).tobytes()
        if key not in seen:
            seen[key] = len(keep)
            keep.append(c)
        index[c] = seen[key]
    return np.ascontiguousarray(m[:, keep]), index


def batch_bootstrap_mean(
    values: Any,
    *,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    rng: Any = None,
    axis: int = 0,
) -> BootstrapResult | list[BootstrapResult]:
    """Batch bootstrap of a mean: resample per-batch values with replacement.

    ``values`` holds one value per batch along ``axis`` (e.g. the per-batch cosine
    gain of SPEC 8).  1-D input gives one :class:`BootstrapResult`; 2-D input
    (batches x statistics) gives one per column, all on the same resamples (so a
    column of differences is a paired difference).
    """
    n_resamples, confidence_level, _ = _check_options(n_resamples, confidence_level, "batch")
    gen = _check_rng(rng)
    v = np.asarray(values, dtype=np.float64)
    if v.ndim not in (1, 2):
        raise ValueError(f"values must be 1-D or 2-D, got {v.ndim}-D")
    one = v.ndim == 1
    v = np.moveaxis(v, axis, 0) if not one else v[:, None]
    if v.shape[0] == 0:
        raise ValueError("values is empty: at least one batch is needed")
    if not np.isfinite(v).all():
        raise ValueError("values contains NaN or infinite values")
    nb = v.shape[0]
    idx = gen.integers(0, nb, size=(n_resamples, nb))
    cnt = np.bincount((idx + (np.arange(n_resamples) * nb)[:, None]).ravel(), minlength=n_resamples * nb)
    reps = (cnt.reshape(n_resamples, nb).astype(np.float64) @ v) / nb
    est = v.mean(axis=0)
    low, high, se, _ = summarize_bootstrap(reps, est, confidence_level)
    out = [
        BootstrapResult(float(est[i]), float(low[i]), float(high[i]), float(se[i]), n_resamples, confidence_level, "percentile", "batch")
        for i in range(v.shape[1])
    ]
    return out[0] if one else out
