"""Paper gradient_alignment_flow: per-batch cosine with the RL gradient, and its permutation control.

Why two flows and a forest: panel (a) links each batch's base and compare cosines,
so a reader sees the gain is consistent across batches rather than driven by one;
panel (b) does the same after permuting the compare multipliers across tokens
(same distribution and mass, pairing destroyed), and panel (c) puts the three
means side by side (gain, permutation gain, pairing-specific gain) with their
batch-bootstrap intervals, the paper's 0.192 / 0.020 / 0.172 comparison.

The result object (SPEC section 8, ``icsd audit gradcos``) must provide:

- ``cos_base``, ``cos_compare``: per-batch cosines (sequences of equal length);
- ``cos_perm``: per-batch cosine under the permuted control, mean over shuffles, or None;
- ``gain``, ``perm_gain``, ``pairing_gain``: :class:`~icsd_audit.stats.bootstrap.BootstrapResult`
  (the last two may be None without a permutation control);
- optional ``mean_base``, ``mean_compare``, ``mean_perm``: BootstrapResults of the mean
  cosines (drawn as diamonds with horizontal interval bars when present);
- optional ``base_name``, ``compare_name`` (default ``"sdar"``, ``"icsd"``).
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
    DIFF_COLOR,
    NEUTRAL_COLOR,
    PERMUTED_COLOR,
    display_name,
    plain,
    new_figure,
    paper_style,
    resolve_axes,
)

__all__ = ["alignment_figure"]


def alignment_figure(result: Any, ax: Axes | Sequence[Axes] | None = None, *, gains: bool = True) -> Figure:
    """Flow panels of per-batch cosines and (``gains``) a forest panel of the mean gains.

    Panels: (a) base -> compare per batch; (b) base -> permuted (when ``cos_perm``
    exists); (c) gains with CIs.  Pass one Axes per panel to embed the figure.
    Gids: ``cos-base-a``, ``cos-compare-a``, ``cos-base-b``, ``cos-perm-b`` on the
    per-batch markers (x data = cosines, y data = batch positions), ``mean-<side>-<panel>``
    on the mean diamonds (errorbar containers) and ``gains`` on the forest's errorbar.
    """
    base = np.asarray(result.cos_base, dtype=float)
    comp = np.asarray(result.cos_compare, dtype=float)
    perm = None if getattr(result, "cos_perm", None) is None else np.asarray(result.cos_perm, dtype=float)
    if base.shape != comp.shape or base.ndim != 1 or (perm is not None and perm.shape != base.shape):
        raise ValueError("cos_base, cos_compare and cos_perm must be 1-D with one value per batch")
    bname = plain(display_name(getattr(result, "base_name", "sdar")))
    cname = plain(display_name(getattr(result, "compare_name", "icsd")))
    has_gains = gains and getattr(result, "gain", None) is not None
    n_flow = 2 if perm is not None else 1
    n = n_flow + (1 if has_gains else 0)
    with paper_style():
        if ax is None:
            # a row per batch, each labelled: at least _ROW inches apart so their labels never touch
            flow_h, gains_h = 1.7 + _ROW * base.size, 1.0
            fig = new_figure(COLUMN_WIDTH, flow_h + (gains_h if has_gains else 0.0))
            gs = fig.add_gridspec(2 if has_gains else 1, n_flow, height_ratios=[flow_h, gains_h] if has_gains else None)
            axes = [fig.add_subplot(gs[0, 0])]
            if n_flow == 2:
                axes.append(fig.add_subplot(gs[0, 1], sharex=axes[0], sharey=axes[0]))
            if has_gains:
                axes.append(fig.add_subplot(gs[1, :]))
        else:
            fig, axes = resolve_axes(ax, n, width=COLUMN_WIDTH, height=3.0)
        y = np.arange(base.size, dtype=float)[::-1]  # first batch on top
        ids = getattr(result, "batch_ids", None)
        labels = [plain(b) for b in ids] if ids is not None and len(ids) == base.size else \
            [str(k) for k in range(1, base.size + 1)]
        _flow(axes[0], y, base, comp, BASE_COLOR, COMPARE_COLOR, "base", "compare", "a",
              getattr(result, "mean_base", None), getattr(result, "mean_compare", None), bname, cname, labels)
        axes[0].set_title(f"(a) {bname} \u2192 {cname}", loc="left")
        if perm is not None:
            _flow(axes[1], y, base, perm, BASE_COLOR, PERMUTED_COLOR, "base", "perm", "b",
                  getattr(result, "mean_base", None), getattr(result, "mean_perm", None), bname, f"{cname} permuted",
                  labels)
            axes[1].set_ylabel("")
            axes[1].set_title(f"(b) {bname} \u2192 permuted {cname}", loc="left")
            axes[1].tick_params(labelleft=False)
        if has_gains:
            _forest(axes[-1], result, cname, "c" if perm is not None else "b")
        handles = [h for a in axes[:n_flow] for h in a.get_lines() if h.get_gid() and h.get_gid().startswith("cos-")]
        unique = {h.get_label(): h for h in handles}
        if ax is None:
            fig.legend(list(unique.values()), list(unique), loc="outside upper center", ncols=len(unique),
                       handletextpad=0.2, columnspacing=1.0)
        else:
            axes[0].legend(list(unique.values()), list(unique), loc="best", fontsize=6)
    return fig


def _flow(ax: Axes, y: np.ndarray, left: np.ndarray, right: np.ndarray, lc: str, rc: str, lname: str, rname: str,
          panel: str, lmean: Any, rmean: Any, llabel: str, rlabel: str, labels: Sequence[str]) -> None:
    for yi, a, b in zip(y, left, right):
        ax.annotate("", xy=(b, yi), xytext=(a, yi),
                    arrowprops=dict(arrowstyle="-|>", color=NEUTRAL_COLOR, lw=0.6, mutation_scale=5,
                                    shrinkA=2, shrinkB=2.5, alpha=0.8))
    ax.plot(left, y, "o", color=lc, markersize=3, linestyle="none", label=llabel, gid=f"cos-{lname}-{panel}", zorder=3)
    ax.plot(right, y, "o", color=rc, markersize=3, linestyle="none", label=rlabel, gid=f"cos-{rname}-{panel}", zorder=3)
    # the two means on their own rows below the batches, so their intervals never overlap
    for mean, color, name, ym in ((lmean, lc, lname, _MEAN_Y[0]), (rmean, rc, rname, _MEAN_Y[1])):
        if mean is None:
            continue
        err = [[max(mean.estimate - mean.ci_low, 0.0)], [max(mean.ci_high - mean.estimate, 0.0)]]
        eb = ax.errorbar([mean.estimate], [ym], xerr=err, fmt="D", color=color, markersize=4,
                         markeredgecolor="black", markeredgewidth=0.4, elinewidth=1.0, capsize=2, zorder=4)
        eb.lines[0].set_gid(f"mean-{name}-{panel}")
        for artist in eb.lines[2]:
            artist.set_gid(f"mean-{name}-{panel}")
    ax.axhline(-0.6, color="#CCCCCC", linewidth=0.4)
    # every batch row labelled with its batch id (the first on top), the two mean rows as one
    ax.set_yticks([sum(_MEAN_Y) / 2, *y], ["means", *labels], fontsize=6 if y.size > 12 else None)
    ax.set_ylabel("batch")
    ax.set_ylim(_MEAN_Y[1] - 0.7, y.max() + 0.8)
    ax.set_xlabel("cosine with the\nRL gradient")
    ax.xaxis.grid(True, linewidth=0.3, color="#DDDDDD", zorder=0)
    ax.set_axisbelow(True)


_MEAN_Y = (-1.3, -2.2)
#: inches per batch row: 6-7 pt labels need about 0.1 in
_ROW = 0.13


def _forest(ax: Axes, result: Any, cname: str, panel: str) -> None:
    rows = [("gain", "gain", DIFF_COLOR), ("perm_gain", "permutation gain", PERMUTED_COLOR),
            ("pairing_gain", "pairing-specific", COMPARE_COLOR)]
    rows = [(k, lab, col) for k, lab, col in rows if getattr(result, k, None) is not None]
    est = np.array([getattr(result, k).estimate for k, _, _ in rows])
    lo = np.array([getattr(result, k).ci_low for k, _, _ in rows])
    hi = np.array([getattr(result, k).ci_high for k, _, _ in rows])
    y = np.arange(len(rows), dtype=float)[::-1]
    ax.axvline(0.0, color="black", linewidth=0.6)
    eb = ax.errorbar(est, y, xerr=np.vstack([np.maximum(est - lo, 0), np.maximum(hi - est, 0)]), fmt="none",
                     ecolor="black", elinewidth=0.9, capsize=2, zorder=3)
    for artist in eb.lines[2]:
        artist.set_gid("gains")
    ax.scatter(est, y, c=[c for _, _, c in rows], marker="D", s=14, edgecolors="black", linewidths=0.4, zorder=4,
               gid="gains-points")
    for yi, e, h in zip(y, est, hi):
        ax.text(max(h, e), yi, f"  {e:+.3f}".replace("-", "\u2212"), va="center", ha="left", fontsize=6.5)
    ax.set_yticks(y, [lab for _, lab, _ in rows])
    ax.set_ylim(-0.7, len(rows) - 0.3)
    span = max(float(np.nanmax(hi)) - min(0.0, float(np.nanmin(lo))), 1e-3)
    ax.set_xlim(min(0.0, float(np.nanmin(lo))) - 0.08 * span, float(np.nanmax(hi)) + 0.35 * span)
    ax.set_xlabel(f"mean cosine gain of {cname} over batches")
    ax.set_title(f"({panel}) gains", loc="left")
