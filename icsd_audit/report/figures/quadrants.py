"""Paper Figure A1: mass share of each sign region under base and compare allocation.

Why this figure: the four (Delta, A) sign regions are where trust and objective
influence agree or conflict; grouped bars with bootstrap whiskers show how much
auxiliary mass each allocation puts there, and a bracket over each pair gives the
paired point difference (compare minus base) in percentage points, which is the
number the paper quotes (+6.2 / -7.5 / -1.5 / 0).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from icsd_audit.report.figures.style import (
    BASE_COLOR,
    COLUMN_WIDTH,
    COMPARE_COLOR,
    display_name,
    plain,
    format_pp,
    paper_style,
    percent,
    resolve_axes,
)

__all__ = ["REGION_LABELS", "quadrant_figure"]

#: tick labels of the regions (mathtext: two short lines fit a column-wide figure)
REGION_LABELS: dict[str, str] = {
    "pos_delta_pos_adv": "$\\Delta>0$\n$\\hat{A}>0$",
    "pos_delta_neg_adv": "$\\Delta>0$\n$\\hat{A}<0$",
    "neg_delta_pos_adv": "$\\Delta<0$\n$\\hat{A}>0$",
    "neg_delta_neg_adv": "$\\Delta<0$\n$\\hat{A}<0$",
    "neutral": "$\\Delta=0$ or\n$\\hat{A}=0$",
}
_FOUR = ("pos_delta_pos_adv", "pos_delta_neg_adv", "neg_delta_pos_adv", "neg_delta_neg_adv")


def quadrant_figure(
    result: Any,
    ax: Axes | None = None,
    *,
    include_neutral: bool = False,
    annotate: bool = True,
    legend: bool = True,
    title: str | None = None,
) -> Figure:
    """Grouped bars of region mass shares (%) with CI whiskers and difference brackets.

    ``result``: a :class:`icsd_audit.stats.api.QuadrantsResult` (fields used: ``regions``
    mapping region name to an object with ``base``/``compare``/``diff``
    :class:`~icsd_audit.stats.bootstrap.BootstrapResult`, ``base_name``, ``compare_name``).
    ``include_neutral`` adds the Delta = 0 or A = 0 remainder as a fifth group (the
    paper shows the four sign regions only).  Bar patches carry gids ``bars-base`` / ``bars-compare``, whisker
    line collections ``whiskers-base`` / ``whiskers-compare``, brackets ``bracket-<region>``.
    """
    names = [r for r in _FOUR if r in result.regions]
    if include_neutral and "neutral" in result.regions:
        names.append("neutral")
    if not names:
        raise ValueError("the quadrants result holds none of the four sign regions")
    with paper_style():
        fig, (axis,) = resolve_axes(ax, 1, width=COLUMN_WIDTH, height=2.3 if len(names) <= 4 else 2.45)
        _draw(axis, result, names, annotate=annotate)
        if legend:
            axis.legend(loc="upper right", ncols=2, handlelength=1.2, columnspacing=1.0, borderaxespad=0.2)
        if title:
            axis.set_title(title)
    return fig


def _draw(ax: Axes, result: Any, names: Sequence[str], *, annotate: bool) -> None:
    x = np.arange(len(names), dtype=float)
    width = 0.38
    tops = np.zeros(len(names))
    for side, offset, color, label in (
        ("base", -width / 2, BASE_COLOR, plain(display_name(result.base_name))),
        ("compare", width / 2, COMPARE_COLOR, plain(display_name(result.compare_name))),
    ):
        est = np.array([percent(getattr(result.regions[r], side).estimate) for r in names])
        lo = np.array([percent(getattr(result.regions[r], side).ci_low) for r in names])
        hi = np.array([percent(getattr(result.regions[r], side).ci_high) for r in names])
        bars = ax.bar(x + offset, est, width, color=color, label=label, linewidth=0, zorder=2)
        for patch in bars.patches:
            patch.set_gid(f"bars-{side}")
        # whisker lengths from the interval; a degenerate interval gives zero-length whiskers
        yerr = np.vstack([np.maximum(est - lo, 0.0), np.maximum(hi - est, 0.0)])
        eb = ax.errorbar(x + offset, est, yerr=yerr, fmt="none", ecolor="black", elinewidth=0.7,
                         capsize=1.8, capthick=0.7, zorder=3)
        for artist in eb.lines[2]:
            artist.set_gid(f"whiskers-{side}")
        tops = np.maximum(tops, np.where(np.isfinite(hi), hi, est))
    ymax = float(np.nanmax(tops)) if np.isfinite(tops).any() else 1.0
    pad = 0.04 * ymax
    if annotate:
        for i, r in enumerate(names):
            y = tops[i] + pad
            xl, xr = x[i] - width / 2, x[i] + width / 2
            (line,) = ax.plot([xl, xl, xr, xr], [y - pad * 0.6, y, y, y - pad * 0.6], color="black",
                              linewidth=0.6, solid_capstyle="butt", zorder=3)
            line.set_gid(f"bracket-{r}")
            text = ax.text(x[i], y + pad * 0.3, format_pp(percent(result.regions[r].diff.estimate)) + " pp",
                           ha="center", va="bottom", fontsize=6.5)
            text.set_gid(f"bracket-{r}")
    ax.set_xticks(x, [REGION_LABELS.get(r, r) for r in names])
    ax.tick_params(axis="x", length=0, pad=3)
    ax.set_ylabel("share of auxiliary mass (%)")
    ax.set_ylim(0, ymax * (1.30 if annotate else 1.12))
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.yaxis.grid(True, linewidth=0.3, color="#DDDDDD", zorder=0)
    ax.set_axisbelow(True)
