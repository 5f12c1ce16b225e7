"""Paper Figure A3 (e-f): trusted mass on negative-advantage tokens over training steps.

Why pale and dark lines: the per-step statistic is computed on one minibatch and
is noisy; the paper draws it pale and overlays a centred five-step mean, which is
what a reader compares between base and compare.  The statistic is TCM: among
teacher-supported tokens (Delta > 0, |u| > eps), u < 0 exactly when A < 0, so TCM
is the share of trusted auxiliary mass on negative-advantage tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator
from matplotlib.figure import Figure

from icsd_audit.report.figures.style import BASE_COLOR, COLUMN_WIDTH, COMPARE_COLOR, DIFF_COLOR, display_name, paper_style, plain, resolve_axes

__all__ = ["dynamics_figure", "centered_mean"]


def centered_mean(steps: Sequence[float], values: Sequence[float], window: int = 5) -> np.ndarray:
    """Mean of the values whose step lies within +-window//2 of each step (display smoothing).

    Windows are in step units, so a missing step shortens a window instead of
    pulling in a distant one; at the ends the window is truncated (as pandas'
    ``rolling(center=True, min_periods=1)`` on a contiguous index).  NaNs are skipped.
    """
    s = np.asarray(steps, dtype=float)
    v = np.asarray(values, dtype=float)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    near = np.abs(s[:, None] - s[None, :]) <= window // 2
    ok = near & np.isfinite(v)[None, :]
    cnt = ok.sum(axis=1)
    tot = np.where(ok, v[None, :], 0.0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, tot / np.maximum(cnt, 1), np.nan)


def _pick(r: Any, region: str | None) -> Any:
    return r if region is None else r.regions[region]


def dynamics_figure(
    result: Any,
    ax: Axes | Sequence[Axes] | None = None,
    *,
    region: str | None = None,
    window: int = 5,
    show_diff: bool = False,
    ylabel: str | None = None,
    title: str | None = None,
) -> Figure:
    """Per-step values (pale) and centred ``window``-step means (dark), base vs compare.

    A run shorter than ``window`` steps gets its per-step values only (a mean over
    the whole run would be one flat line), drawn with markers as for any run of up
    to 12 evenly spread steps, which also get a tick each.

    ``result``: a :class:`icsd_audit.stats.api.GroupedResult` grouped by step (numeric
    ``keys``) whose ``results`` have ``base``/``compare``/``diff`` BootstrapResults
    (a TCMResult), or QuadrantsResults with ``region`` naming the region to draw.
    ``show_diff`` adds a lower panel: per-step paired difference with its CI band.
    Values are plotted in percent.  Gids: ``step-<side>`` (pale lines, y = 100 x
    estimate), ``mean-<side>`` (dark lines), ``diff-step``, ``diff-mean``, ``diff-ci``.
    """
    steps = np.asarray([float(k) for k in result.keys])
    if steps.size == 0:
        raise ValueError("the grouped result holds no steps")
    order = np.argsort(steps, kind="stable")
    steps = steps[order]
    items = [_pick(result.results[i], region) for i in order]
    first = result.results[0]
    names = {"base": getattr(first, "base_name", "sdar"), "compare": getattr(first, "compare_name", "icsd")}
    span = int(steps.max() - steps.min()) + 1
    smooth = window <= span  # a centred mean over a run shorter than its window is one flat line: draw the points
    few = steps.size <= 12  # few points: markers, every step its own tick
    # ... unless the steps bunch up (0-10 and 1000): their own ticks would run together
    few = few and (steps.size < 2 or 12 * np.diff(steps).min() >= steps[-1] - steps[0])
    with paper_style():
        fig, axes = resolve_axes(ax, 2 if show_diff else 1, width=COLUMN_WIDTH, height=3.2 if show_diff else 2.1,
                                 layout=(2, 1) if show_diff else None, sharex=True)
        main = axes[0]
        mark = dict(marker="o", markersize=3) if few else {}
        for side, color in (("base", BASE_COLOR), ("compare", COMPARE_COLOR)):
            y = np.array([100.0 * getattr(r, side).estimate for r in items])
            label = plain(display_name(names[side]))
            if smooth:
                main.plot(steps, y, color=color, alpha=0.35, linewidth=0.7, gid=f"step-{side}", **mark)
                main.plot(steps, centered_mean(steps, y, window), color=color, linewidth=1.5, label=label,
                          gid=f"mean-{side}")
            else:
                main.plot(steps, y, color=color, linewidth=1.2, label=label, gid=f"step-{side}", **mark)
        main.set_ylabel(ylabel or ("trusted mass on $\\hat{A}<0$ (%)" if region is None else plain(f"{region} share (%)")))
        main.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, title_fontsize=6, borderaxespad=0.2,
                    title=window_caption(steps, window))
        main.yaxis.grid(True, linewidth=0.3, color="#DDDDDD")
        if title:
            main.set_title(title)
        if show_diff:
            low = axes[1]
            d = np.array([100.0 * r.diff.estimate for r in items])
            lo = np.array([100.0 * r.diff.ci_low for r in items])
            hi = np.array([100.0 * r.diff.ci_high for r in items])
            if steps.size == 1:  # no band through one point: its interval as an error bar
                eb = low.errorbar(steps, d, yerr=np.vstack([np.maximum(d - lo, 0), np.maximum(hi - d, 0)]),
                                  fmt="o", color=DIFF_COLOR, markersize=3, elinewidth=0.9, capsize=2)
                eb.lines[0].set_gid("diff-step")
                for artist in eb.lines[2]:
                    artist.set_gid("diff-ci")
            else:
                band = low.fill_between(steps, lo, hi, color=DIFF_COLOR, alpha=0.2, linewidth=0)
                band.set_gid("diff-ci")
                low.plot(steps, d, color=DIFF_COLOR, alpha=0.45 if smooth else 1.0, linewidth=0.7, gid="diff-step",
                         **mark)
            if smooth:
                low.plot(steps, centered_mean(steps, d, window), color=DIFF_COLOR, linewidth=1.5, gid="diff-mean")
            low.axhline(0.0, color="black", linewidth=0.6)
            low.set_ylabel(plain(f"{display_name(names['compare'])} \u2212 {display_name(names['base'])} (pp)"))
            low.yaxis.grid(True, linewidth=0.3, color="#DDDDDD")
        axes[-1].set_xlabel("training step")
        if few:  # every step its own tick, the points off the frame's edges
            axes[-1].set_xticks(steps, [f"{int(s)}" for s in steps])
            axes[-1].set_xlim(steps.min() - 0.5, steps.max() + 0.5)
        else:  # steps are integers: ticks only there (a 2-step run got 0.0, 0.2, ... 1.0)
            axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    return fig


def window_caption(steps: np.ndarray, window: int) -> str:
    """The legend title: what pale and dark lines are, or that a run shorter than the window shows its points."""
    span = int(steps.max() - steps.min()) + 1 if steps.size else 0
    if window <= span:
        return f"pale: per step; dark: centred {window}-step mean"
    return f"per step ({span} step{'s' if span != 1 else ''}: too few for a {window}-step mean)"
