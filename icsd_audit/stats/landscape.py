"""Continuous allocation landscape (paper eq. normalized_allocation_intensity).

Within each environment, delta and advantage get mid-ranks scaled to (0, 1); a square
grid of joint rank bins carries, per cell, the mean weight divided by the
environment's mean weight (intensity, 1 = average allocation) and the token share
(density, for contours).  The grid itself is a point estimate (descriptive).

Two additions (docs/statistics.md defines them):

* **Local smoothing** (the paper's "locally smoothed" intensity): a Nadaraya-Watson
  estimate on the grid with an isotropic Gaussian kernel of standard deviation
  ``bandwidth`` in scaled-rank units (default 0.05, one cell of the default 20 x 20
  grid), truncated at 3 standard deviations: smoothed sum of weights / smoothed token
  count in each cell, divided by the environment's mean weight.  Cells with no token
  within the kernel's reach are NaN.
* **Region multipliers** with action-turn bootstrap CIs: for a region R of the rank
  square, mean weight over R / mean weight over the environment (the intensity of R
  as one bin), for both weightings and their ratio (compare / base).

**Exact, in two passes, in bounded memory.**  A value's mid-rank bin depends on it only
through its rank among all the environment's values, so a first pass over delta and
advantage alone (:class:`LandscapeRanks`: 4 bytes per valid token of delta, the
advantages, constant over a turn, as distinct values with counts) cuts each axis into
exact value edges (:class:`RankEdges`, the bins of SPEC 6 and of
:func:`~icsd_audit.stats.accumulator.midrank_bins` to the token); the second pass
(:class:`LandscapeAccumulator`) bins every allocated batch as it streams and keeps only
the G x G cell sums and nine floats per action turn for the region bootstrap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from icsd_audit.stats.accumulator import check_weight_names
from icsd_audit.stats.bootstrap import (
    BootstrapResult, RatioBootstrapResult, RatioFamily, summarize_bootstrap, bootstrap_ratio_families,
)
from icsd_audit.tokens import Tokens, Weights
from icsd_audit.stats.rank_edges import REGION_QUANTILE, unsorted_value_edges, value_edges
from icsd_audit.stats.results import LANDSCAPE_GRID, json_float, json_key, check_names
from icsd_audit.stats.turns import ClusterIndex, as_numpy, check_finite, check_turns, masked

__all__ = ["LandscapeGrid", "LandscapeResult", "LandscapeAccumulator", "LandscapeRanks", "RankEdges", "landscape",
           "RegionMultiplier", "LANDSCAPE_REGIONS", "SMOOTHING_BANDWIDTH", "REGION_QUANTILE", "smooth_intensity",
           "scaled_midranks"]

#: Standard deviation of the Gaussian smoothing kernel, in scaled-rank units.
SMOOTHING_BANDWIDTH = 0.05
#: Kernel truncation, in standard deviations.
SMOOTHING_TRUNCATE = 3.0
#: Region name -> its definition (docs/statistics.md); q_T, q_R = scaled mid-ranks of delta, advantage.
LANDSCAPE_REGIONS = {
    "trusted_supported": "q_T >= 0.8 and q_R >= 0.8, delta > 0 and advantage > 0",
    "trusted_opposed": "q_T >= 0.8, delta > 0 and advantage < 0",
}


@dataclass(frozen=True)
class RegionMultiplier:
    """Mean weight over a region / mean weight over its environment, with bootstrap CIs."""

    region: str
    n_tokens: int
    token_share: float
    base: BootstrapResult
    compare: BootstrapResult
    ratio: BootstrapResult  # compare multiplier / base multiplier

    def to_dict(self, base_name: str, compare_name: str) -> dict[str, Any]:
        return {"region": self.region, "definition": LANDSCAPE_REGIONS.get(self.region, ""),
                "n_tokens": int(self.n_tokens), "token_share": json_float(self.token_share),
                base_name: self.base.to_dict(), compare_name: self.compare.to_dict(), "ratio": self.ratio.to_dict()}


def scaled_midranks(values: np.ndarray) -> np.ndarray:
    """(rank - 1/2) / n with average ranks for ties, in (0, 1)."""
    v = np.asarray(values)
    uniq, inv = np.unique(v, return_inverse=True)
    eq = np.bincount(inv.reshape(-1), minlength=uniq.size).astype(np.float64)
    below = np.concatenate([[0.0], np.cumsum(eq)[:-1]])
    return ((2 * below + eq) / (2 * v.size))[inv.reshape(-1)]


@dataclass(frozen=True)
class RankEdges:
    """One environment's exact mid-rank bins, as value thresholds (SPEC 6, computed once from the values).

    A value x has delta bin ``#{b : delta[b] <= x}`` (``delta[b]`` = the smallest value
    whose bin is b + 1), identical to :func:`~icsd_audit.stats.accumulator.midrank_bins`
    over all the environment's values; ``delta_top`` is the smallest value whose scaled
    mid-rank is at least :data:`REGION_QUANTILE` (+inf if none); likewise for the advantage.
    """

    n: int
    delta: np.ndarray
    advantage: np.ndarray
    delta_top: float
    advantage_top: float
    zero_rank: Mapping[str, float]


class LandscapeRanks:
    """The first pass of the landscape: each environment's delta and advantage values, then exact bin edges.

    Delta values are kept as given (4 bytes per valid token from a float32 dump);
    advantages, constant over a turn, are kept as distinct values with counts per
    batch.  :meth:`finalize` sorts them once per environment into :class:`RankEdges`.
    """

    def __init__(self, *, grid: int = LANDSCAPE_GRID):
        if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or grid < 1:
            raise ValueError(f"grid must be a positive integer, got {grid!r}")
        self.grid = int(grid)
        self._delta: dict[Any, list[np.ndarray]] = {}
        self._adv: dict[Any, list[tuple[np.ndarray, np.ndarray]]] = {}

    def add(self, delta: Any, advantage: Any, *, env: Any = None, valid: Any = None) -> None:
        """Values of one batch (``env``: per-token labels or None; ``valid``: rows that count)."""
        d = as_numpy(delta, "delta")
        a = as_numpy(advantage, "advantage", d.shape[0])
        keep = np.ones(d.shape[0], bool) if valid is None else as_numpy(valid, "valid", d.shape[0]).astype(bool)
        keep &= np.isfinite(d) & np.isfinite(a)  # (non-finite values are the reader's error to report)
        if env is None:
            parts = [(None, keep)]
        else:
            e = as_numpy(env, "env", d.shape[0])
            parts = [(k.item() if hasattr(k, "item") else k, keep & (e == k)) for k in np.unique(e[keep])]
        for key, sel in parts:
            if not sel.any():
                continue
            self._delta.setdefault(key, []).append(d[sel] if not sel.all() else d.copy())
            self._adv.setdefault(key, []).append(_value_counts(a[sel] if not sel.all() else a))

    def finalize(self) -> dict[Any, RankEdges]:
        """Edges per environment (the lists are released as they are used)."""
        out: dict[Any, RankEdges] = {}
        for key in list(self._delta):
            parts = self._delta.pop(key)
            d = np.concatenate(parts) if len(parts) > 1 else parts[0]
            del parts
            de, dtop, dzero = unsorted_value_edges(d, self.grid)  # (d is ours: it is overwritten)
            n = d.size
            del d
            av = self._adv.pop(key)
            vals, inv = np.unique(np.concatenate([v for v, _ in av]), return_inverse=True)
            cnt = np.bincount(inv.reshape(-1), weights=np.concatenate([c for _, c in av]), minlength=vals.size)
            ae, atop, azero = value_edges(vals, cnt.astype(np.int64), self.grid)
            out[key] = RankEdges(n=n, delta=de, advantage=ae, delta_top=dtop, advantage_top=atop,
                                 zero_rank={"delta": dzero, "advantage": azero})
        return out


def _run_starts(x: np.ndarray) -> np.ndarray | None:
    """Where the runs of equal values of ``x`` start (an advantage is constant over a turn); None for short runs."""
    if x.size < 2:
        return None
    starts = np.flatnonzero(x[1:] != x[:-1]) + 1
    return None if 4 * starts.size > x.size else np.concatenate([[0], starts])


def _value_counts(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, return_counts=True)`` from one value per run (the same values and counts, a smaller sort)."""
    starts = _run_starts(a)
    if starts is None:
        return np.unique(a, return_counts=True)
    vals, inv = np.unique(a[starts], return_inverse=True)
    lengths = np.diff(np.append(starts, a.size))
    return vals, np.bincount(inv.reshape(-1), weights=lengths, minlength=vals.size).astype(np.int64)


def _kernel_matrix(bandwidth: float, grid: int) -> np.ndarray:
    """W[i, k] = exp(-(i - k)^2 / (2 h^2)) for |i - k| <= ceil(3 h), h = bandwidth * grid cells; else 0."""
    h = bandwidth * grid
    r = int(np.ceil(SMOOTHING_TRUNCATE * h))
    lag = np.subtract.outer(np.arange(grid), np.arange(grid)).astype(np.float64)
    return np.where(np.abs(lag) <= r, np.exp(-0.5 * (lag / h) ** 2), 0.0)


def smooth_intensity(sums: np.ndarray, counts: np.ndarray, mean: float, *, bandwidth: float = SMOOTHING_BANDWIDTH
                     ) -> np.ndarray:
    """Nadaraya-Watson smoothed intensity on the grid: (K * sums) / (K * counts) / mean (NaN where K * counts = 0)."""
    W = _kernel_matrix(bandwidth, counts.shape[0])
    # separable kernel, zero outside the grid: W X W^T
    s = W @ np.asarray(sums, dtype=np.float64) @ W.T
    n = W @ np.asarray(counts, dtype=np.float64) @ W.T
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 1e-12 * max(float(n.max()), 1.0), s / np.where(n > 0, n, 1.0) / mean, np.nan)



@dataclass(frozen=True)
class LandscapeGrid:
    """One environment's landscape: rows are delta mid-rank bins, columns advantage bins.

    ``intensity[name][i, j]`` = mean weight in bin (i, j) / mean weight over the
    environment (NaN for empty bins); ``density`` = token share per bin; ``zero_rank``
    = scaled mid-rank position of a zero delta / zero advantage,
    (#below + #equal / 2) / n, where the plots draw their dotted zero lines.
    """

    env: Any
    n_tokens: int
    grid: int
    intensity: Mapping[str, np.ndarray]
    mean: Mapping[str, float]
    density: np.ndarray
    counts: np.ndarray
    zero_rank: Mapping[str, float]
    #: locally smoothed intensity per weighting (None when not computed)
    smoothed: Mapping[str, np.ndarray] | None = None
    #: region multipliers by region name (None when not computed)
    regions: Mapping[str, RegionMultiplier] | None = None

    def to_dict(self, base_name: str = "sdar", compare_name: str = "icsd") -> dict[str, Any]:
        d = {
            "env": json_key(self.env),
            "n_tokens": int(self.n_tokens),
            "grid": int(self.grid),
            "intensity": {k: _nested(v) for k, v in self.intensity.items()},
            "mean": {k: json_float(v) for k, v in self.mean.items()},
            "density": _nested(self.density),
            "counts": self.counts.astype(int).tolist(),
            "zero_rank": {k: json_float(v) for k, v in self.zero_rank.items()},
        }
        if self.smoothed is not None:
            d["smoothed_intensity"] = {k: _nested(v) for k, v in self.smoothed.items()}
        if self.regions is not None:
            d["regions"] = {k: r.to_dict(base_name, compare_name) for k, r in self.regions.items()}
        return d


def _nested(a: np.ndarray) -> list[list[float | None]]:
    return [[json_float(x) for x in row] for row in np.asarray(a, dtype=np.float64)]


@dataclass(frozen=True)
class LandscapeResult:
    """Landscape grids per environment (one entry, env None, without an env column)."""

    base_name: str
    compare_name: str
    grid: int
    envs: Mapping[Any, LandscapeGrid]
    #: kernel, bandwidth and truncation of ``smoothed_intensity`` (None when not computed)
    smoothing: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {
            "base": self.base_name,
            "compare": self.compare_name,
            "grid": int(self.grid),
            "axes": {"rows": "delta mid-rank bin", "cols": "advantage mid-rank bin"},
            "envs": [g.to_dict(self.base_name, self.compare_name) for g in self.envs.values()],
        }
        if self.smoothing is not None:
            d["smoothing"] = dict(self.smoothing)
        return d


class LandscapeAccumulator:
    """The landscape batch by batch: grid sums and per-turn region sums, a few floats per turn.

    Given the environments' :class:`RankEdges` (``ranks``, from a first pass such as
    :class:`LandscapeRanks` over the same tokens), :meth:`add` reduces each batch at once
    to per-cell sums and per-turn sums (streaming: memory does not grow with tokens).
    Without ``ranks`` the batches are kept compactly (values, weights and a turn index,
    about 30 bytes per valid token) and replayed through the same reduction at
    :meth:`finalize`, after the edges are computed from them: the same numbers.
    """

    def __init__(self, *, grid: int = LANDSCAPE_GRID, base_name: str = "sdar", compare_name: str = "icsd",
                 ranks: Mapping[Any, RankEdges] | None = None):
        if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or grid < 1:
            raise ValueError(f"grid must be a positive integer, got {grid!r}")
        self.grid = int(grid)
        self.base_name, self.compare_name = check_names(base_name, compare_name)
        self.ranks = dict(ranks) if ranks is not None else None
        self._pending: list[tuple[Any, ...]] = []  # batches kept until the edges are known
        self._rows = 0
        self._has_env: bool | None = None
        G2 = self.grid * self.grid
        self._cells: dict[Any, np.ndarray] = {}  # env -> (3, G*G): token count, base sum, compare sum
        self._region_tokens: dict[Any, np.ndarray] = {}  # env -> tokens in each region
        self._turn: dict[str, list[np.ndarray]] = {k: [] for k in ("batch", "env", "sums")}
        self._G2 = G2

    def add(self, tokens: Tokens, weights: Weights, *, env: Any = None, turns: ClusterIndex | None = None) -> None:
        """Add the tokens of one or more batches and their weightings (``env`` for all batches or none).

        ``turns``: the action turns of the valid rows, :func:`~icsd_audit.stats.turns.turn_index` of these
        tokens, when the caller has them (the report shares one per batch between its accumulators).
        """
        check_weight_names(weights, self.base_name, self.compare_name)
        d = as_numpy(tokens.delta, "delta")
        n = d.shape[0]
        a = as_numpy(tokens.advantage, "advantage", n)
        # action-turn ids for the region bootstrap (batch, trajectory, turn)
        bid = np.zeros(n, dtype=np.int64) if tokens.batch_id is None else as_numpy(tokens.batch_id, "batch_id", n)
        tid = as_numpy(tokens.traj_id, "traj_id", n)
        uid = as_numpy(tokens.turn_id, "turn_id", n)
        wb = as_numpy(weights.base, self.base_name, n)
        wc = as_numpy(weights.compare, self.compare_name, n)
        has_env = env is not None
        if self._has_env is not None and self._has_env != has_env:
            raise ValueError("env must be given for every batch or for none")
        self._has_env = has_env
        e = as_numpy(env, "env", n) if has_env else None
        rows = None
        if tokens.valid is not None:
            k = as_numpy(tokens.valid, "valid", n).astype(bool)
            if not k.all():
                rows = np.flatnonzero(k)
                d, a, wb, wc, bid, tid, uid = (x[rows] for x in (d, a, wb, wc, bid, tid, uid))
                e = None if e is None else e[rows]
        for name, x, nonneg in (("delta", d, False), ("advantage", a, False), (self.base_name, wb, True),
                                (self.compare_name, wc, True)):
            check_finite(name, x, nonnegative=nonneg, offset=self._rows, rows=rows)
        self._rows += n
        if d.size == 0:
            return
        if self.ranks is None:  # (kept until the edges are known: copies, not the caller's arrays)
            self._pending.append((d, a, wb.astype(np.float64), wc.astype(np.float64), e, bid, tid, uid))
        else:
            check_turns(turns, d.size)
            self._reduce(d, a, np.asarray(wb, dtype=np.float64), np.asarray(wc, dtype=np.float64), e, bid, tid, uid,
                         turns=turns)

    def merge(self, part: "LandscapeAccumulator") -> None:
        """Append ``part``, an accumulator of the same grid and rank edges holding one batch, after the batches here.

        The same bits as adding that batch here: its cell sums started from zero, so adding
        them is adding its bincounts; its per-turn sums are kept as computed.
        """
        if (part.grid, part.base_name, part.compare_name) != (self.grid, self.base_name, self.compare_name):
            raise ValueError("merge: the part was built with other settings")
        if self.ranks is None or part.ranks is None or part._pending:
            raise ValueError("merge: both accumulators need the rank edges of a first pass")
        if part._has_env is not None:
            if self._has_env is not None and self._has_env != part._has_env:
                raise ValueError("env must be given for every batch or for none")
            self._has_env = part._has_env
        for key, cells in part._cells.items():
            acc = self._cells.setdefault(key, np.zeros((3, self._G2)))
            acc += cells
        for key, n in part._region_tokens.items():
            self._region_tokens[key] = self._region_tokens.get(key, 0) + n
        for k, v in part._turn.items():
            self._turn[k].extend(v)
        self._rows += part._rows

    def _reduce(self, d: np.ndarray, a: np.ndarray, wb: np.ndarray, wc: np.ndarray, e: np.ndarray | None,
                bid: np.ndarray, tid: np.ndarray, uid: np.ndarray, turns: ClusterIndex | None = None) -> None:
        """Cell sums and per-turn region sums of one batch's valid tokens (``turns``: their turns, if known)."""
        G = self.grid
        keys = [None] if e is None else [k.item() if hasattr(k, "item") else k for k in np.unique(e)]
        cell = np.empty(d.size, np.int64)
        ts = np.empty(d.size, bool)
        to = np.empty(d.size, bool)
        ecode = np.zeros(d.size, np.int64) if e is not None else None
        for code, key in enumerate(keys):
            sel = slice(None) if e is None else (e == key)
            r = self.ranks.get(key) if self.ranks is not None else None
            if r is None:
                raise ValueError(f"no rank edges for environment {key!r}: the first pass did not see it")
            dk, ak = d[sel], a[sel]
            cell[sel] = _bins(r.delta, dk) * G + _run_bins(r.advantage, ak)
            top = dk >= r.delta_top
            ts[sel] = top & (ak >= r.advantage_top) & (dk > 0) & (ak > 0)
            to[sel] = top & (dk > 0) & (ak < 0)
            if ecode is not None:
                ecode[sel] = code
            c = cell[sel]
            acc = self._cells.setdefault(key, np.zeros((3, self._G2)))
            acc[0] += np.bincount(c, minlength=self._G2)
            acc[1] += np.bincount(c, weights=wb[sel], minlength=self._G2)
            acc[2] += np.bincount(c, weights=wc[sel], minlength=self._G2)
            self._region_tokens[key] = self._region_tokens.get(key, 0) + np.array([ts[sel].sum(), to[sel].sum()])
        if ecode is not None:
            cid = ClusterIndex(bid, tid, uid, ecode)
        elif turns is not None:
            cid = turns
        else:
            cid = ClusterIndex(bid, tid, uid)
        # a count as float64 is the bits of the sum of as many 1.0s (integers add exactly), without their arrays
        buf = np.empty(d.size, dtype=np.float64)
        sums = [cid.count().astype(np.float64), cid.sum(wb), cid.sum(wc)]
        for m in (ts, to):
            sums += [cid.count_where(m).astype(np.float64), cid.sum(masked(wb, m, buf)), cid.sum(masked(wc, m, buf))]
        self._turn["batch"].append(bid[cid.first])
        self._turn["env"].append(np.array(keys, dtype=object)[ecode[cid.first]] if e is not None
                                 else np.zeros(cid.n, np.int64))
        self._turn["sums"].append(np.stack(sums))

    def _flush(self) -> None:
        """Without a first pass: edges from the kept batches, then their reduction (in input order)."""
        if self.ranks is not None:
            return
        ranks = LandscapeRanks(grid=self.grid)
        for d, a, _, _, e, *_ in self._pending:
            ranks.add(d, a, env=e)
        self.ranks = ranks.finalize()
        pending, self._pending = self._pending, []
        for part in pending:
            self._reduce(*part)

    def families(self) -> list[tuple[str, RatioFamily]]:
        """The region multipliers' bootstrap request (empty without tokens in a region's environment)."""
        self._flush()
        if not self._turn["sums"]:
            raise ValueError("no valid tokens for the landscape")
        S = np.concatenate(self._turn["sums"], axis=1)  # (9, turns)
        env = np.concatenate(self._turn["env"])
        batch = np.concatenate(self._turn["batch"])
        self._turn = {"sums": [S], "env": [env], "batch": [batch]}  # the pieces are not kept beside it
        # ratios: region token share, region mass share (base, compare) per region
        num, den = [], []
        for j in range(2):
            c0 = 3 + 3 * j
            num += [c0, c0 + 1, c0 + 2]
            den += [0, 1, 2]
        self._env_of_turn = env
        return [("landscape", RatioFamily(S.T, num, den, strata=batch, groups=_sortable(env)))]

    def grids(self, *, bandwidth: float = SMOOTHING_BANDWIDTH) -> dict[Any, LandscapeGrid]:
        """Every environment's grid (sorted by environment), smoothed, without regions."""
        self._flush()
        if not self._cells:
            raise ValueError("no valid tokens for the landscape")
        if not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
            raise ValueError(f"bandwidth must be > 0 (scaled-rank units), got {bandwidth!r}")
        G = self.grid
        envs: dict[Any, LandscapeGrid] = {}
        for key in _sorted_keys(self._cells):
            cells = self._cells[key]
            counts = cells[0].astype(np.int64).reshape(G, G)
            n = int(counts.sum())
            inten, means, smoothed = {}, {}, {}
            for name, s in ((self.base_name, cells[1].reshape(G, G)), (self.compare_name, cells[2].reshape(G, G))):
                mean_all = float(s.sum()) / n
                with np.errstate(invalid="ignore", divide="ignore"):
                    inten[name] = np.where(counts > 0, (s / np.maximum(counts, 1)) / mean_all, np.nan)
                smoothed[name] = (smooth_intensity(s, counts, mean_all, bandwidth=bandwidth) if mean_all > 0
                                  else np.full((G, G), np.nan))
                means[name] = mean_all
            envs[key] = LandscapeGrid(env=key, n_tokens=n, grid=G, intensity=inten, mean=means,
                                      density=counts / n, counts=counts, zero_rank=dict(self.ranks[key].zero_rank),
                                      smoothed=smoothed)
        return envs

    def result(self, grids: Mapping[Any, LandscapeGrid], raw: RatioBootstrapResult | None, *,
               bandwidth: float = SMOOTHING_BANDWIDTH) -> LandscapeResult:
        """The result from :meth:`grids` and the bootstrap of :meth:`families` (None: no regions)."""
        if raw is not None:
            regions = _regions(raw, self._env_of_turn, self._region_tokens)
            grids = {key: replace(g, regions=regions[key]) if key in regions else g for key, g in grids.items()}
        smoothing = {"kernel": "gaussian", "bandwidth": float(bandwidth), "units": "scaled mid-rank",
                     "truncate": SMOOTHING_TRUNCATE, "estimator": "Nadaraya-Watson on the grid"}
        return LandscapeResult(self.base_name, self.compare_name, self.grid, grids, smoothing=smoothing)

    def finalize(self, *, bandwidth: float = SMOOTHING_BANDWIDTH, n_resamples: int = 10_000,
                 confidence_level: float = 0.95, rng: Any = None, workers: int = 1) -> LandscapeResult:
        """The grids, their smoothed intensity and the region multipliers (``n_resamples=0``: no regions)."""
        grids = self.grids(bandwidth=bandwidth)
        raw = None
        if n_resamples:
            (_, fam), = self.families()
            raw, = bootstrap_ratio_families([fam], n_resamples=n_resamples, confidence_level=confidence_level,
                                            rng=rng, workers=workers, keep_replicates=True)
        return self.result(grids, raw, bandwidth=bandwidth)


def _bins(edges: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Number of edges at or below each value (= ``searchsorted(edges, x, "right")``), as int64.

    A comparison pass per edge into a small counter beats a binary search per value
    (branchy, ~25 ns) for the few edges of a landscape grid.
    """
    if edges.size > 48:
        return np.searchsorted(edges, x, side="right")
    out = np.zeros(x.size, dtype=np.int8)
    for e in edges.tolist():
        np.add(out, x >= e, out=out, casting="unsafe")
    return out.astype(np.int64)


def _run_bins(edges: np.ndarray, x: np.ndarray) -> np.ndarray:
    """:func:`_bins` of values that come in runs (an advantage is constant over a turn): once per run, repeated."""
    starts = _run_starts(x)
    if starts is None:
        return _bins(edges, x)
    return np.repeat(_bins(edges, x[starts]), np.diff(np.append(starts, x.size)))


def _sorted_keys(d: Mapping[Any, Any]) -> list[Any]:
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def _sortable(env: np.ndarray) -> np.ndarray:
    """Per-turn environment as integer ranks in sorted order of the environments (None: all 0)."""
    keys = _sorted_keys(dict.fromkeys(env.tolist()))
    rank = {k: i for i, k in enumerate(keys)}
    return np.array([rank[k] for k in env.tolist()], dtype=np.int64) if env.dtype == object else env


def _regions(raw: RatioBootstrapResult, env_of_turn: np.ndarray, region_tokens: Mapping[Any, np.ndarray]
             ) -> dict[Any, dict[str, RegionMultiplier]]:
    """Region multipliers per environment from the bootstrap of the per-turn region sums."""
    keys = _sorted_keys(region_tokens) if env_of_turn.dtype == object else [None]
    reps = np.asarray(raw.replicates, dtype=np.float64)  # (R, groups, 3 * regions)
    est = np.asarray(raw.estimate, dtype=np.float64)
    cl = raw.confidence_level
    out: dict[Any, dict[str, RegionMultiplier]] = {}
    for gi, gval in enumerate(raw.groups):
        regs: dict[str, RegionMultiplier] = {}
        for j, name in enumerate(LANDSCAPE_REGIONS):
            ts, mb, mc = (3 * j, 3 * j + 1, 3 * j + 2)
            with np.errstate(invalid="ignore", divide="ignore"):
                rep = np.stack([reps[:, gi, mb] / reps[:, gi, ts], reps[:, gi, mc] / reps[:, gi, ts],
                                reps[:, gi, mc] / reps[:, gi, mb]], axis=1)
                e3 = np.array([est[gi, mb] / est[gi, ts], est[gi, mc] / est[gi, ts], est[gi, mc] / est[gi, mb]])
            rep = np.where(np.isfinite(rep), rep, np.nan)
            e3 = np.where(np.isfinite(e3), e3, np.nan)
            low, high, se, _ = summarize_bootstrap(rep, e3, cl)
            br = [BootstrapResult(float(e3[i]), float(low[i]), float(high[i]), float(se[i]), raw.n_resamples,
                                  float(cl), "percentile", "action-turn") for i in range(3)]
            regs[name] = RegionMultiplier(region=name, n_tokens=int(region_tokens[keys[int(gval)]][j]),
                                          token_share=float(est[gi, ts]), base=br[0], compare=br[1], ratio=br[2])
        out[keys[int(gval)]] = regs
    return out


def landscape(
    tokens: Tokens,
    weights: Weights,
    *,
    env: Any = None,
    grid: int = LANDSCAPE_GRID,
    bandwidth: float = SMOOTHING_BANDWIDTH,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    rng: Any = None,
) -> LandscapeResult:
    """Normalized allocation intensity on a joint mid-rank grid, per environment.

    Within each environment, delta and advantage get mid-ranks scaled to (0, 1),
    q = (rank - 1/2) / n (average ranks for ties), and bin floor(grid * q); per
    cell (i = delta bin, j = advantage bin), intensity = mean w in the cell / mean w
    in the environment, for both weightings; ``density`` is the token share per cell;
    ``smoothed`` the Gaussian-kernel Nadaraya-Watson intensity (``bandwidth`` in
    scaled-rank units); ``regions`` the region multipliers with action-turn bootstrap
    CIs (``n_resamples`` resamples within batches; 0 skips them).
    ``env``: per-token environment labels, or the name of a column of ``tokens``
    (``"env"``); None pools every token as one environment.
    """
    acc = LandscapeAccumulator(grid=grid, base_name=weights.base_name, compare_name=weights.compare_name)
    acc.add(tokens, weights, env=tokens.column(env) if isinstance(env, str) else env)
    return acc.finalize(bandwidth=bandwidth, n_resamples=n_resamples, confidence_level=confidence_level, rng=rng)
