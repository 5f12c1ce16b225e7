"""Paper continuous_joint_allocation (c): conditional share shift by advantage bin inside S+.

Why: among teacher-supported tokens (Delta > 0), the share of mass each
equal-frequency advantage bin receives under the compare allocation minus under
the base allocation, in percentage points, shows the redistribution directly:
negative bins should lose mass and positive bins gain it.  Exact-zero advantages
have no rank order, so their bin is drawn apart (grey, open marker) rather than
between the two sides as if it were one more quantile.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory

from icsd_audit.report.figures.style import COLUMN_WIDTH, COMPARE_COLOR, NEUTRAL_COLOR, display_name, paper_style, plain, resolve_axes

__all__ = ["shift_figure", "shift_positions"]


def shift_positions(n_bins: int) -> dict[str, float]:
    """x position of each bin label: negatives 0..n-1, a gap, zero, a gap, positives."""
    pos = {f"neg_{i}": float(i - 1) for i in range(1, n_bins + 1)}
    pos["zero"] = float(n_bins + 0.5)
    pos.update({f"pos_{i}": float(n_bins + 1 + i) for i in range(1, n_bins + 1)})
    return pos


def shift_figure(result: Any, ax: Axes | None = None, *, title: str | None = None, color: str = COMPARE_COLOR) -> Figure:
    """Share shift (pp) per advantage bin with CI whiskers; the zero bin separate.

    ``result``: a :class:`icsd_audit.stats.api.ShiftResult` (fields used: ``n_bins``,
    ``bins`` mapping ``neg_1`` (most negative) .. ``neg_n``, ``zero``, ``pos_1`` ..
    ``pos_n`` (largest) to objects with ``diff`` (a fraction; plotted x 100) and
    ``n_tokens``; ``base_name``, ``compare_name``).  Empty bins are not drawn.
    Gids: ``shift-signed`` (the ten signed bins) and ``shift-zero``, each an
    errorbar container whose data line holds the plotted points.
    """
    pos = shift_positions(int(result.n_bins))
    with paper_style():
        fig, (axis,) = resolve_axes(ax, 1, width=COLUMN_WIDTH, height=2.1)
        axis.axhline(0.0, color="black", linewidth=0.6, zorder=1)
        for gid, labels, kw in (
            ("shift-signed", [k for k in pos if k != "zero"], dict(fmt="o", color=color, markersize=3.6)),
            ("shift-zero", ["zero"], dict(fmt="o", color=NEUTRAL_COLOR, markersize=3.6, markerfacecolor="white")),
        ):
            keep = [k for k in labels if k in result.bins and result.bins[k].n_tokens > 0
                    and np.isfinite(result.bins[k].diff.estimate)]
            if not keep:
                continue
            x = np.array([pos[k] for k in keep])
            est = np.array([100.0 * result.bins[k].diff.estimate for k in keep])
            lo = np.array([100.0 * result.bins[k].diff.ci_low for k in keep])
            hi = np.array([100.0 * result.bins[k].diff.ci_high for k in keep])
            yerr = np.vstack([np.maximum(est - lo, 0.0), np.maximum(hi - est, 0.0)])
            eb = axis.errorbar(x, est, yerr=yerr, elinewidth=0.8, capsize=1.8, capthick=0.8, linestyle="none",
                               zorder=3, **kw)
            eb.lines[0].set_gid(gid)
            for artist in eb.lines[2]:
                artist.set_gid(gid)
        n = int(result.n_bins)
        ticks = [pos[f"neg_{i}"] for i in range(1, n + 1)] + [pos["zero"]] + [pos[f"pos_{i}"] for i in range(1, n + 1)]
        labels = [str(i) for i in range(1, n + 1)] + ["0"] + [str(i) for i in range(1, n + 1)]
        axis.set_xticks(ticks, labels)
        axis.set_xlim(-0.8, pos[f"pos_{n}"] + 0.8)
        for x in (pos["zero"] - 0.75, pos["zero"] + 0.75):
            axis.axvline(x, color="#BBBBBB", linewidth=0.4, linestyle="--", zorder=0)
        tr = blended_transform_factory(axis.transData, axis.transAxes)
        axis.text((n - 1) / 2, 0.98, "$\\hat{A}<0$", transform=tr, ha="center", va="top", fontsize=7)
        axis.text(pos["pos_1"] + (n - 1) / 2, 0.98, "$\\hat{A}>0$", transform=tr, ha="center", va="top", fontsize=7)
        axis.set_xlabel("equal-frequency advantage bin inside $\\mathcal{S}^+$ (low \u2192 high)")
        axis.set_ylabel(plain(f"share shift, {display_name(result.compare_name)} \u2212 {display_name(result.base_name)} (pp)"))
        lo_all, hi_all = axis.get_ylim()
        span = hi_all - lo_all
        axis.set_ylim(lo_all, hi_all + 0.12 * span)  # room for the side labels
        axis.yaxis.grid(True, linewidth=0.3, color="#DDDDDD", zorder=0)
        axis.set_axisbelow(True)
        if title:
            axis.set_title(title)
    return fig
