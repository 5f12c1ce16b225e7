"""``icsd compare`` figures: learning curves per group and the mechanism trajectory, with bootstrap bands.

Each takes the :class:`icsd_audit.runs.curves.Curve` objects of a comparison and returns a
Figure; the lines are the per-step mean over a group's runs, the bands the percentile
interval of that mean over runs (absent where a group has one run).  Colours follow the
report: SDAR orange, ICSD blue (the audit's base / compare roles), no distillation black,
other groups the remaining Okabe-Ito colours in display order.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from icsd_audit.report.figures.style import (BASE_COLOR, COLUMN_WIDTH, COMPARE_COLOR, OKABE_ITO, TEXT_WIDTH,
                                             display_name, paper_style, plain, resolve_axes)

__all__ = ["curves_figure", "mechanism_figure", "group_colors", "MECHANISM_PANELS"]

_FIXED = {"sdar": BASE_COLOR, "icsd": COMPARE_COLOR, "none": OKABE_ITO["black"]}
_OTHERS = ("bluish_green", "vermillion", "reddish_purple", "sky_blue", "yellow")
#: key -> y label of the mechanism panels (values drawn in percent).
MECHANISM_PANELS = {
    "alloc/tcm": "TCM under c (%)",
    "alloc/share/pos_delta_neg_adv": "share of c on $\\Delta>0, \\hat{A}<0$ (%)",
    "alloc/share/pos_delta_pos_adv": "share of c on $\\Delta>0, \\hat{A}>0$ (%)",
}


def group_colors(labels: Sequence[str]) -> dict[str, str]:
    """Label -> colour: allocator names keep the report's roles; the rest take Okabe-Ito colours in order."""
    out, spare = {}, iter(_OTHERS * (1 + len(labels) // len(_OTHERS)))
    for lab in labels:
        last = lab.split("/")[-1].lower()
        out[lab] = _FIXED.get(last) or OKABE_ITO[next(spare)]
    return out


def _legend_name(label: str) -> str:
    return plain("/".join(display_name(p) for p in label.split("/")))


def _draw(ax: Axes, curves: Sequence[Any], colors: dict[str, str], scale: float) -> None:
    for c in curves:
        color = colors[c.label]
        if np.isfinite(c.ci_low).any():
            band = ax.fill_between(c.steps, scale * c.ci_low, scale * c.ci_high, color=color, alpha=0.18, linewidth=0)
            band.set_gid(f"band-{c.label}")
        ax.plot(c.steps, scale * c.mean, color=color, linewidth=1.3, marker="o" if c.steps.size < 3 else None,
                markersize=2.5, label=f"{_legend_name(c.label)} (n={int(c.n_runs.max())})", gid=f"mean-{c.label}")
    ax.yaxis.grid(True, linewidth=0.3, color="#DDDDDD")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def curves_figure(curves: Sequence[Any], key: str, ax: Axes | Sequence[Axes] | None = None, *,
                  labels: Sequence[str] | None = None, ylabel: str | None = None, percent: bool = False) -> Figure:
    """One panel per environment: the ``key`` curve of each group, mean line and band.

    Gids: ``mean-<label>`` (lines), ``band-<label>`` (bands).  ``percent`` scales fractions by 100.
    """
    mine = [c for c in curves if c.key == key]
    if not mine:
        raise ValueError(f"no curve of {key!r}")
    envs = list(dict.fromkeys(c.env for c in mine))
    labels = list(labels or dict.fromkeys(c.label for c in mine))
    colors = group_colors(labels)
    scale = 100.0 if percent else 1.0
    with paper_style():
        width = COLUMN_WIDTH if len(envs) == 1 else min(TEXT_WIDTH, COLUMN_WIDTH * len(envs) * 0.8)
        fig, axes = resolve_axes(ax, len(envs), width=width, height=2.2)
        for a, env in zip(axes, envs):
            _draw(a, sorted((c for c in mine if c.env == env), key=lambda c: labels.index(c.label)), colors, scale)
            if len(envs) > 1:
                a.set_title(plain(env))
            a.set_xlabel("training step")
        axes[0].set_ylabel(ylabel or plain(f"{key} (%)" if percent else key))
        axes[0].legend(loc="lower center", bbox_to_anchor=(0.5, 1.0 if len(envs) == 1 else 1.1), ncols=min(3, len(labels)),
                       borderaxespad=0.2, title=_band_caption(mine), title_fontsize=6)
    return fig


def mechanism_figure(curves: Sequence[Any], ax: Axes | Sequence[Axes] | None = None, *,
                     labels: Sequence[str] | None = None) -> Figure:
    """TCM and the conflict-region shares per training step (in percent), one panel per key of
    :data:`MECHANISM_PANELS` that some group logged; for the first environment with such curves."""
    keys = [k for k in MECHANISM_PANELS if any(c.key == k for c in curves)]
    if not keys:
        raise ValueError("no mechanism curve (alloc/tcm, alloc/share/...) to draw")
    env = next(c.env for c in curves if c.key in keys)
    mine = [c for c in curves if c.env == env and c.key in keys]
    labels = [lab for lab in (labels or dict.fromkeys(c.label for c in mine)) if any(c.label == lab for c in mine)]
    colors = group_colors(labels)
    with paper_style():
        fig, axes = resolve_axes(ax, len(keys), width=min(TEXT_WIDTH, max(COLUMN_WIDTH, 2.4 * len(keys))), height=2.2)
        for a, key in zip(axes, keys):
            _draw(a, sorted((c for c in mine if c.key == key), key=lambda c: labels.index(c.label)), colors, 100.0)
            a.set_ylabel(MECHANISM_PANELS[key])
            a.set_xlabel("training step")
        legend = dict(ncols=min(4, len(labels)), title=f"{plain(env)}: " + _band_caption(mine), title_fontsize=6)
        if ax is None:  # above all panels: as the first panel's legend it widened that column and squeezed the
            # others until a 200-step run's tick labels ran together
            fig.legend(*axes[0].get_legend_handles_labels(), loc="outside upper center", **legend)
        else:
            axes[0].legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), borderaxespad=0.2, **legend)
    return fig


def _band_caption(curves: Sequence[Any]) -> str:
    c = curves[0]
    if not any(np.isfinite(x.ci_low).any() for x in curves):
        return "mean over runs (one run per group: no band)"
    return f"mean over runs; band: {100 * c.confidence_level:g} % bootstrap CI over runs"
