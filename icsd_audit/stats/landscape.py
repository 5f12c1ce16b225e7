"""Continuous allocation landscape (paper eq. normalized_allocation_intensity).

Within each environment, delta and advantage get mid-ranks scaled to (0, 1); a square
grid of joint rank bins carries, per cell, the mean weight divided by the
environment's mean weight (intensity, 1 = average allocation) and the token share
(density, for contours).  Point estimates only: the plotted quantity is descriptive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from icsd_audit.stats.accumulator import _check_weight_names, midrank_bins
from icsd_audit.tokens import Tokens, Weights
from icsd_audit.stats.results import LANDSCAPE_GRID, json_float, json_key, check_names
from icsd_audit.stats.turns import GroupCodes, as_numpy, check_finite

__all__ = ["LandscapeGrid", "LandscapeResult", "LandscapeAccumulator", "landscape"]



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

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": json_key(self.env),
            "n_tokens": int(self.n_tokens),
            "grid": int(self.grid),
            "intensity": {k: _nested(v) for k, v in self.intensity.items()},
            "mean": {k: json_float(v) for k, v in self.mean.items()},
            "density": _nested(self.density),
            "counts": self.counts.astype(int).tolist(),
            "zero_rank": {k: json_float(v) for k, v in self.zero_rank.items()},
        }


def _nested(a: np.ndarray) -> list[list[float | None]]:
    return [[json_float(x) for x in row] for row in np.asarray(a, dtype=np.float64)]


@dataclass(frozen=True)
class LandscapeResult:
    """Landscape grids per environment (one entry, env None, without an env column)."""

    base_name: str
    compare_name: str
    grid: int
    envs: Mapping[Any, LandscapeGrid]

    def to_dict(self) -> dict[str, Any]:
        return {
            "base": self.base_name,
            "compare": self.compare_name,
            "grid": int(self.grid),
            "axes": {"rows": "delta mid-rank bin", "cols": "advantage mid-rank bin"},
            "envs": [g.to_dict() for g in self.envs.values()],
        }


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
        for name, x, nonneg in (("delta", d, False), ("advantage", a, False), (self.base_name, wb, True), (self.compare_name, wc, True)):
            check_finite(name, x, nonnegative=nonneg, offset=self._rows, rows=rows)
        self._rows += n
        self._parts.append((d, a, wb.astype(np.float64), wc.astype(np.float64), e))

    def finalize(self) -> LandscapeResult:
        if not self._parts or sum(p[0].size for p in self._parts) == 0:
            raise ValueError("no valid tokens for the landscape")
        d, a, wb, wc, e = (np.concatenate([p[i] for p in self._parts]) for i in range(5))
        rank, values = self._envs.order()
        er = rank[e]
        envs: dict[Any, LandscapeGrid] = {}
        G = self.grid
        for k, val in enumerate(values):
            sel = np.flatnonzero(er == k)
            if sel.size == 0:
                continue
            i = midrank_bins(d[sel], G)
            j = midrank_bins(a[sel], G)
            cell = i * G + j
            counts = np.bincount(cell, minlength=G * G).reshape(G, G)
            inten, means = {}, {}
            for name, w in ((self.base_name, wb[sel]), (self.compare_name, wc[sel])):
                s = np.bincount(cell, weights=w, minlength=G * G).reshape(G, G)
                mean_all = float(w.sum()) / sel.size
                with np.errstate(invalid="ignore", divide="ignore"):
                    inten[name] = np.where(counts > 0, (s / np.maximum(counts, 1)) / mean_all, np.nan)
                means[name] = mean_all
            key = val if self._has_env else None
            zero = {
                name: (float((x < 0).sum()) + 0.5 * float((x == 0).sum())) / sel.size
                for name, x in (("delta", d[sel]), ("advantage", a[sel]))
            }
            envs[key] = LandscapeGrid(
                env=key, n_tokens=int(sel.size), grid=G, intensity=inten, mean=means,
                density=counts / sel.size, counts=counts, zero_rank=zero,
            )
        return LandscapeResult(self.base_name, self.compare_name, G, envs)


def landscape(
    tokens: Tokens,
    weights: Weights,
    *,
    env: Any = None,
    grid: int = LANDSCAPE_GRID,
) -> LandscapeResult:
    """Normalized allocation intensity on a joint mid-rank grid, per environment.

    Within each environment, delta and advantage get mid-ranks scaled to (0, 1),
    q = (rank - 1/2) / n (average ranks for ties), and bin floor(grid * q); per
    cell (i = delta bin, j = advantage bin), intensity = mean w in the cell / mean w
    in the environment, for both weightings; ``density`` is the token share per cell.
    ``env``: per-token environment labels, or the name of a column of ``tokens``
    (``"env"``); None pools every token as one environment.
    """
    acc = LandscapeAccumulator(grid=grid, base_name=weights.base_name, compare_name=weights.compare_name)
    acc.add(tokens, weights, env=tokens.column(env) if isinstance(env, str) else env)
    return acc.finalize()
