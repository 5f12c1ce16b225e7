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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from icsd_audit.stats.accumulator import _check_weight_names, midrank_bins
from icsd_audit.stats.bootstrap import BootstrapResult, _summarize, bootstrap_ratio_columns
from icsd_audit.tokens import Tokens, Weights
from icsd_audit.stats.results import LANDSCAPE_GRID, json_float, json_key, check_names
from icsd_audit.stats.turns import GroupCodes, as_numpy, check_finite

__all__ = ["LandscapeGrid", "LandscapeResult", "LandscapeAccumulator", "landscape", "RegionMultiplier",
           "LANDSCAPE_REGIONS", "SMOOTHING_BANDWIDTH", "REGION_QUANTILE", "smooth_intensity", "scaled_midranks"]

#: Standard deviation of the Gaussian smoothing kernel, in scaled-rank units.
SMOOTHING_BANDWIDTH = 0.05
#: Kernel truncation, in standard deviations.
SMOOTHING_TRUNCATE = 3.0
#: "Strongly" trusted / supported: scaled mid-rank at least this (the top fifth).
REGION_QUANTILE = 0.8
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
    """Collect (delta, advantage, weights, env) batch by batch for :func:`landscape`.

    Mid-ranks are pooled over all batches of an environment, so the token columns
    are kept (about 28 bytes per valid token).
    """

    def __init__(self, *, grid: int = LANDSCAPE_GRID, base_name: str = "sdar", compare_name: str = "icsd"):
        if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or grid < 1:
            raise ValueError(f"grid must be a positive integer, got {grid!r}")
        self.grid = int(grid)
        self.base_name, self.compare_name = check_names(base_name, compare_name)
        self._parts: list[tuple[np.ndarray, ...]] = []
        self._envs = GroupCodes()
        self._rows = 0
        self._has_env: bool | None = None

    def add(self, tokens: Tokens, weights: Weights, *, env: Any = None) -> None:
        """Add the tokens of one or more batches and their weightings (``env`` for all batches or none)."""
        _check_weight_names(weights, self.base_name, self.compare_name)
        delta, advantage, valid, base, compare = tokens.delta, tokens.advantage, tokens.valid, weights.base, weights.compare
        d = as_numpy(delta, "delta")
        n = d.shape[0]
        a = as_numpy(advantage, "advantage", n)
        # action-turn ids for the region bootstrap (batch, trajectory, turn)
        bid = np.zeros(n, dtype=np.int64) if tokens.batch_id is None else as_numpy(tokens.batch_id, "batch_id", n)
        tid = as_numpy(tokens.traj_id, "traj_id", n)
        uid = as_numpy(tokens.turn_id, "turn_id", n)
        wb = as_numpy(base, self.base_name, n)
        wc = as_numpy(compare, self.compare_name, n)
        has_env = env is not None
        if self._has_env is not None and self._has_env != has_env:
            raise ValueError("env must be given for every batch or for none")
        self._has_env = has_env
        e = self._envs.encode(as_numpy(env, "env", n) if has_env else np.zeros(n, dtype=np.int64))
        rows = None
        if valid is not None:
            k = as_numpy(valid, "valid", n).astype(bool)
            if not k.all():
                rows = np.flatnonzero(k)
                d, a, wb, wc, e = d[rows], a[rows], wb[rows], wc[rows], e[rows]
                bid, tid, uid = bid[rows], tid[rows], uid[rows]
        for name, x, nonneg in (("delta", d, False), ("advantage", a, False), (self.base_name, wb, True), (self.compare_name, wc, True)):
            check_finite(name, x, nonnegative=nonneg, offset=self._rows, rows=rows)
        self._rows += n
        self._parts.append((d, a, wb.astype(np.float64), wc.astype(np.float64), e,
                            np.asarray(bid, dtype=np.int64), np.asarray(tid, dtype=np.int64),
                            np.asarray(uid, dtype=np.int64)))

    def finalize(self, *, bandwidth: float = SMOOTHING_BANDWIDTH, n_resamples: int = 10_000,
                 confidence_level: float = 0.95, rng: Any = None) -> LandscapeResult:
        """The grids, their smoothed intensity and the region multipliers (``n_resamples=0``: no regions)."""
        if not self._parts or sum(p[0].size for p in self._parts) == 0:
            raise ValueError("no valid tokens for the landscape")
        if not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
            raise ValueError(f"bandwidth must be > 0 (scaled-rank units), got {bandwidth!r}")
        d, a, wb, wc, e, bid, tid, uid = (np.concatenate([p[i] for p in self._parts]) for i in range(8))
        rank, values = self._envs.order()
        er = rank[e]
        envs: dict[Any, LandscapeGrid] = {}
        code_of: dict[Any, int] = {}
        G = self.grid
        for k, val in enumerate(values):
            sel = np.flatnonzero(er == k)
            if sel.size == 0:
                continue
            i = midrank_bins(d[sel], G)
            j = midrank_bins(a[sel], G)
            cell = i * G + j
            counts = np.bincount(cell, minlength=G * G).reshape(G, G)
            inten, means, smoothed = {}, {}, {}
            for name, w in ((self.base_name, wb[sel]), (self.compare_name, wc[sel])):
                s = np.bincount(cell, weights=w, minlength=G * G).reshape(G, G)
                mean_all = float(w.sum()) / sel.size
                with np.errstate(invalid="ignore", divide="ignore"):
                    inten[name] = np.where(counts > 0, (s / np.maximum(counts, 1)) / mean_all, np.nan)
                    smoothed[name] = (smooth_intensity(s, counts, mean_all, bandwidth=bandwidth) if mean_all > 0
                                      else np.full((G, G), np.nan))
                means[name] = mean_all
            key = val if self._has_env else None
            code_of[key] = k
            zero = {
                name: (float((x < 0).sum()) + 0.5 * float((x == 0).sum())) / sel.size
                for name, x in (("delta", d[sel]), ("advantage", a[sel]))
            }
            envs[key] = LandscapeGrid(
                env=key, n_tokens=int(sel.size), grid=G, intensity=inten, mean=means,
                density=counts / sel.size, counts=counts, zero_rank=zero, smoothed=smoothed,
            )
        if n_resamples:
            regions = self._regions(d, a, wb, wc, er, bid, tid, uid, list(envs), n_resamples=n_resamples,
                                    confidence_level=confidence_level, rng=rng)
            envs = {key: _with_regions(g, regions.get(code_of[key])) for key, g in envs.items()}
        smoothing = {"kernel": "gaussian", "bandwidth": float(bandwidth), "units": "scaled mid-rank",
                     "truncate": SMOOTHING_TRUNCATE, "estimator": "Nadaraya-Watson on the grid"}
        return LandscapeResult(self.base_name, self.compare_name, G, envs, smoothing=smoothing)

    def _regions(self, d: np.ndarray, a: np.ndarray, wb: np.ndarray, wc: np.ndarray, er: np.ndarray, bid: np.ndarray,
                 tid: np.ndarray, uid: np.ndarray, keys: list, *, n_resamples: int, confidence_level: float,
                 rng: Any) -> dict[int, dict[str, RegionMultiplier]]:
        """Region multipliers per environment (index into ``keys``), one stratified turn bootstrap for all."""
        n = d.size
        present = [k for k in range(int(er.max()) + 1) if (er == k).any()]
        qt, qr = np.empty(n), np.empty(n)
        for k in present:
            sel = er == k
            qt[sel], qr[sel] = scaled_midranks(d[sel]), scaled_midranks(a[sel])
        masks = {
            "trusted_supported": (qt >= REGION_QUANTILE) & (qr >= REGION_QUANTILE) & (d > 0) & (a > 0),
            "trusted_opposed": (qt >= REGION_QUANTILE) & (d > 0) & (a < 0),
        }
        # one cluster per (environment, batch, trajectory, turn); per-cluster sums
        _, cl = np.unique(np.stack([er, bid, tid, uid]), axis=1, return_inverse=True)
        cl = cl.reshape(-1)
        m = int(cl.max()) + 1
        one = np.ones(n)
        cols = [one, wb, wc] + [x * masks[r] for r in masks for x in (one, wb, wc)]
        S = np.stack([np.bincount(cl, weights=c, minlength=m) for c in cols], axis=1)
        first = np.zeros(m, dtype=np.int64)
        first[cl[::-1]] = np.arange(n)[::-1]
        # ratios: region token share, region mass share (base, compare) per region
        num, den = [], []
        for j in range(len(masks)):
            c0 = 3 + 3 * j
            num += [c0, c0 + 1, c0 + 2]
            den += [0, 1, 2]
        res = bootstrap_ratio_columns(S, num, den, strata=bid[first], groups=er[first], n_resamples=n_resamples,
                                      confidence_level=confidence_level, rng=rng, keep_replicates=True)
        reps = np.asarray(res.replicates, dtype=np.float64)  # (R, groups, 3 * regions)
        est = np.asarray(res.estimate, dtype=np.float64)
        out: dict[int, dict[str, RegionMultiplier]] = {}
        for gi, gval in enumerate(res.groups):
            regs: dict[str, RegionMultiplier] = {}
            for j, name in enumerate(masks):
                ts, mb, mc = (3 * j, 3 * j + 1, 3 * j + 2)
                with np.errstate(invalid="ignore", divide="ignore"):
                    rep = np.stack([reps[:, gi, mb] / reps[:, gi, ts], reps[:, gi, mc] / reps[:, gi, ts],
                                    reps[:, gi, mc] / reps[:, gi, mb]], axis=1)
                    e3 = np.array([est[gi, mb] / est[gi, ts], est[gi, mc] / est[gi, ts], est[gi, mc] / est[gi, mb]])
                rep = np.where(np.isfinite(rep), rep, np.nan)
                e3 = np.where(np.isfinite(e3), e3, np.nan)
                low, high, se, _ = _summarize(rep, e3, confidence_level)
                br = [BootstrapResult(float(e3[i]), float(low[i]), float(high[i]), float(se[i]), int(n_resamples),
                                      float(confidence_level), "percentile", "action-turn") for i in range(3)]
                sel = er == int(gval)
                regs[name] = RegionMultiplier(region=name, n_tokens=int(masks[name][sel].sum()),
                                              token_share=float(est[gi, ts]), base=br[0], compare=br[1], ratio=br[2])
            out[int(gval)] = regs
        return out


def _with_regions(g: LandscapeGrid, regions: Mapping[str, RegionMultiplier] | None) -> LandscapeGrid:
    from dataclasses import replace

    return replace(g, regions=regions) if regions is not None else g


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
