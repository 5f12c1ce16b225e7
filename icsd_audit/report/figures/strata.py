"""Token strata (SPEC 11): mass share and trusted-conflict mass per covariate bin, both allocations.

Why: the questions asked of self-distillation are token-level (does the mass sit on
high-entropy "forking" tokens, on low-probability tokens, early or late in a reply?).
The left panel puts each allocation's share of all mass in a bin beside the bin's share
of tokens (grey ticks: where the mass would be if every token weighed the same); the
right panel gives each bin's trusted-conflict mass.  Whiskers are the action-turn
bootstrap intervals of the result; bins whose TCM is undefined are left out of the
right panel (the report's table says why).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from icsd_audit.report.figures.style import (
    BASE_COLOR, COMPARE_COLOR, TEXT_WIDTH, display_name, paper_style, resolve_axes,
)

__all__ = ["strata_figure", "covariate_label"]

_LABELS = {"entropy": "next-token entropy", "logp": "log-probability of the token", "pos": "position in the turn",
           "abs_delta": "$|\\Delta|$"}


def covariate_label(covariate: str) -> str:
    return _LABELS.get(covariate, covariate)


def _whiskers(axis: Axes, x: np.ndarray, results: list[Any], color: str, gid: str, **kw: Any) -> None:
    est = np.array([100.0 * r.estimate for r in results])
    ok = np.isfinite(est)
    if not ok.any():
        return
    lo = np.array([100.0 * r.ci_low for r in results])[ok]
    hi = np.array([100.0 * r.ci_high for r in results])[ok]
    yerr = np.vstack([np.maximum(est[ok] - lo, 0.0), np.maximum(hi - est[ok], 0.0)])
    eb = axis.errorbar(x[ok], est[ok], yerr=yerr, color=color, elinewidth=0.8, capsize=1.8, capthick=0.8,
                       linestyle="none", markersize=3.6, zorder=3, **kw)
    eb.lines[0].set_gid(gid)
    for artist in eb.lines[2]:
        artist.set_gid(gid)


def strata_figure(result: Any, axes: Any = None, *, title: str | None = None) -> Figure:
    """Two panels over the bins of ``result``: mass share (%) and TCM (%) of base and compare, with whiskers.

    ``result``: a :class:`icsd_audit.stats.results.StrataResult` (fields used: ``bins``
    with ``token_share``, ``share`` and ``tcm``, ``covariate``, ``spec``, ``base_name``,
    ``compare_name``).  Gids: ``share-base``, ``share-compare``, ``tcm-base``, ``tcm-compare``
    (errorbar data lines and whiskers) and ``token-share``.
    """
    bins = list(result.bins)
    x = np.arange(len(bins), dtype=np.float64)
    off = 0.12
    bn, cn = display_name(result.base_name), display_name(result.compare_name)
    with paper_style():
        fig, (left, right) = resolve_axes(axes, 2, width=TEXT_WIDTH, height=2.3)
        ts = np.array([100.0 * b.token_share.estimate for b in bins])
        left.scatter(x, ts, marker="_", s=120, color="#7F7F7F", linewidths=1.2, zorder=2, label="token share",
                     gid="token-share")
        _whiskers(left, x - off, [b.share.base for b in bins], BASE_COLOR, "share-base", fmt="o", label=bn)
        _whiskers(left, x + off, [b.share.compare for b in bins], COMPARE_COLOR, "share-compare", fmt="s", label=cn)
        _whiskers(right, x - off, [b.tcm.base for b in bins], BASE_COLOR, "tcm-base", fmt="o", label=bn)
        _whiskers(right, x + off, [b.tcm.compare for b in bins], COMPARE_COLOR, "tcm-compare", fmt="s", label=cn)
        top = result.spec.top
        labels = [str(b.index) for b in bins] if top is None else ["rest", f"top {100 * top:g} %"]
        for axis, ylabel in ((left, "share of all mass (%)"), (right, "trusted-conflict mass (%)")):
            axis.set_xticks(x, labels)
            axis.set_xlim(-0.6, len(bins) - 0.4)
            axis.set_xlabel(f"bin of {covariate_label(result.covariate)} (low \u2192 high)")
            axis.set_ylabel(ylabel)
            axis.yaxis.grid(True, linewidth=0.3, color="#DDDDDD", zorder=0)
            axis.set_axisbelow(True)
        left.legend(loc="best", fontsize=6, frameon=False)
        if title:
            fig.suptitle(title)
    return fig
