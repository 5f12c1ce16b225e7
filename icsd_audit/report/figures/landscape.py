"""Paper continuous_joint_allocation (a-b): allocation intensity over the joint rank grid.

Why ranks: delta and advantage live on unrelated, heavy-tailed scales; their
within-environment mid-ranks put every token on the unit square, so the colour
shows where (in teacher preference x objective support) each allocation spends
its mass relative to its own average (1 = the environment's mean coefficient),
and the grey density contours show where the tokens actually are.  Dotted lines
mark the rank position of a zero signal, so the four sign regions of Figure A1
are the four quadrants of each panel.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory

from icsd_audit.report.figures.style import COLUMN_WIDTH, DENSITY_COLOR, LANDSCAPE_CMAP, TEXT_WIDTH, display_name, paper_style, plain, resolve_axes

__all__ = ["landscape_figure", "zero_rank_of", "smooth_density", "CONTOUR_LEVELS"]

#: density contour levels, as multiples of the independence density (1x is left out:
#: under independence it would trace sampling noise)
CONTOUR_LEVELS = (0.5, 2.0, 4.0, 8.0)

_ALL = object()
EMPTY_COLOR = "#E0E0E0"
_PANEL = "abcdefghijklmnopqrstuvwxyz"


def zero_rank_of(grid: Any, zero_ranks: Mapping[Any, Mapping[str, float]] | None = None) -> dict[str, float]:
    """Scaled mid-rank of a zero delta / zero advantage for one environment's grid.

    Looked up in ``zero_ranks[grid.env]`` (keys ``"delta"``, ``"advantage"``) if given,
    else in the grid's own ``zero_rank`` mapping if the statistics provide one; {}
    when neither knows it (then no dotted lines are drawn).
    """
    if zero_ranks is not None and grid.env in zero_ranks:
        return {k: float(v) for k, v in zero_ranks[grid.env].items() if v is not None}
    own = getattr(grid, "zero_rank", None)
    return {k: float(v) for k, v in own.items() if v is not None} if own else {}


def smooth_density(density: np.ndarray) -> np.ndarray:
    """Display smoothing of a token-share grid for its contours: a separable [1, 2, 1] / 4 filter.

    Raw cell shares carry multinomial noise of order sqrt(share / n); contour lines
    traced through it wiggle around every cell.  One pass of the binomial filter
    (edge cells mirrored, so the total is preserved exactly) keeps the shape of real
    concentrations, which span several cells.  Only the density contours use this
    filter.  The colours are another matter: by default (``landscape_figure(smoothed=True)``)
    they show the locally smoothed intensity that :mod:`icsd_audit.stats.landscape`
    computes with its Gaussian kernel (the paper's plotted quantity), and the raw bin
    intensity only with ``smoothed=False`` or when the result carries no smoothed grid.
    """
    d = np.asarray(density, dtype=float)
    if d.ndim != 2 or min(d.shape) < 3:
        return d
    for axis in (0, 1):
        p = np.pad(d, [(1, 1) if a == axis else (0, 0) for a in range(2)], mode="symmetric")
        lo = np.take(p, range(0, d.shape[axis]), axis=axis)
        mid = np.take(p, range(1, d.shape[axis] + 1), axis=axis)
        hi = np.take(p, range(2, d.shape[axis] + 2), axis=axis)
        d = (lo + 2 * mid + hi) / 4
    return d


def landscape_figure(
    result: Any,
    ax: Axes | Sequence[Axes] | None = None,
    *,
    env: Any = _ALL,
    weightings: Sequence[str] = ("base", "compare"),
    zero_ranks: Mapping[Any, Mapping[str, float]] | None = None,
    contours: bool = True,
    colorbar: bool = True,
    vmax: float | None = None,
    smoothed: bool = True,
    regions: bool = True,
) -> Figure:
    """Heatmaps of normalized allocation intensity, one panel per (environment, weighting).

    ``result``: a :class:`icsd_audit.stats.api.LandscapeResult` (fields used: ``envs``
    mapping env to a grid with ``intensity`` {weighting name: (G, G) array, rows =
    delta rank bins, columns = advantage rank bins}, ``density`` (G, G), ``env``, and
    optionally ``zero_rank``; ``base_name``, ``compare_name``).  ``weightings`` picks
    ``"base"`` and/or ``"compare"``; ``env`` one environment (default: all).
    Delta rank runs along x and advantage rank along y, so a mesh's array is the
    transposed intensity.  One colour scale is shared by all panels: a diverging
    split at 1 (the environment mean) on the sequential Blues map, darker = more mass.
    Gids: ``intensity-<env>-<weighting>`` on each mesh, ``density-<env>`` on contours,
    ``zero-delta-<env>`` / ``zero-advantage-<env>`` on the dotted lines.
    ``smoothed``: colour the locally smoothed intensity (the paper's plotted quantity)
    where the result carries it (``grid.smoothed``), else the raw bin intensity.
    ``regions``: outline the region multipliers' regions (``grid.regions``) and label
    each with its multiplier under the panel's weighting (gid
    ``region-<name>-<env>-<weighting>``).
    """
    grids = list(result.envs.values()) if env is _ALL else [result.envs[env]]
    if not grids:
        raise ValueError("the landscape result holds no environment")
    names = {"base": result.base_name, "compare": result.compare_name}
    for w in weightings:
        if w not in names:
            raise ValueError(f"weighting must be 'base' or 'compare', got {w!r}")
    panels = [(g, names[w]) for g in grids for w in weightings]
    finite = [_shown(g, n, smoothed) for g, n in panels]
    top = vmax if vmax is not None else max((float(np.nanmax(a)) for a in finite if np.isfinite(a).any()), default=2.0)
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(top, 1.05))
    n = len(panels)

    def w_of(k: int) -> str:
        return "compare" if panels[k][1] == result.compare_name else "base"

    with paper_style():
        # one row per environment, one column per weighting
        rows, cols = len(grids), len(weightings)
        width = COLUMN_WIDTH if cols <= 2 else min(TEXT_WIDTH, 1.6 * cols + 0.6)
        fig, axes = resolve_axes(ax, n, width=width, height=0.3 + 1.65 * rows, layout=(rows, cols))
        mesh = None
        for k, (axis, (grid, name)) in enumerate(zip(axes, panels)):
            mesh = _panel(axis, grid, name, norm, zero_rank_of(grid, zero_ranks), contours=contours, smoothed=smoothed)
            if regions:
                _regions(axis, grid, name, zero_rank_of(grid, zero_ranks), which=w_of(k))
            # two lines with an environment: a long env name must not run into the colour bar
            label = plain(display_name(name) if grid.env is None else f"{grid.env}\n{display_name(name)}")
            axis.set_title(f"({_PANEL[k % 26]}) {label}", loc="left")
            if k % cols:  # the rank axes are shared along a row: the labels of the first panel say it
                axis.set_ylabel("")
                axis.tick_params(labelleft=False)
            if k < n - cols:
                axis.set_xlabel("")
        if colorbar and mesh is not None:
            cb = fig.colorbar(mesh, ax=axes, shrink=0.72, pad=0.02, aspect=22)
            ticks = [t for t in (0, 0.5, 1, 1.5, 2, 3, 4, 6, 8) if t <= norm.vmax]
            cb.set_ticks(ticks, labels=[f"{t:g}\u00d7" for t in ticks])
            cb.set_label("mean coefficient / env. mean")
            cb.outline.set_linewidth(0.4)
    return fig


def _shown(grid: Any, name: str, smoothed: bool) -> np.ndarray:
    sm = getattr(grid, "smoothed", None)
    if smoothed and sm is not None and name in sm:
        return np.asarray(sm[name], dtype=float)
    return np.asarray(grid.intensity[name], dtype=float)


def _regions(ax: Axes, grid: Any, name: str, zero: dict[str, float], *, which: str) -> None:
    """Dashed outlines of the region-multiplier regions, labelled with this weighting's multiplier."""
    regs = getattr(grid, "regions", None)
    if not regs:
        return
    from matplotlib.patches import Rectangle

    tag = "all" if grid.env is None else str(grid.env)
    zt, zr = zero.get("delta", 0.0), zero.get("advantage", 0.0)
    for rname, r in regs.items():
        x0 = max(0.8, zt)
        if rname == "trusted_supported":
            y0, y1 = max(0.8, zr), 1.0
        elif rname == "trusted_opposed":
            y0, y1 = 0.0, zr
        else:
            continue
        if x0 >= 1.0 or y1 <= y0:
            continue
        est = getattr(r, which).estimate
        ax.add_patch(Rectangle((x0, y0), 1.0 - x0, y1 - y0, fill=False, linestyle=(0, (3, 2)), linewidth=0.7,
                               edgecolor="#B2182B", gid=f"region-{rname}-{tag}-{name}"))
        if est == est:  # beside the panel, level with its box: never over the cells or the contours
            ax.text(1.03, (y0 + y1) / 2, f"{est:.2f}\u00d7", ha="left", va="center", fontsize=6, color="#B2182B",
                    transform=blended_transform_factory(ax.transAxes, ax.transData), clip_on=False,
                    gid=f"region-label-{rname}-{tag}-{name}")


def _panel(ax: Axes, grid: Any, name: str, norm: TwoSlopeNorm, zero: dict[str, float], *, contours: bool,
           smoothed: bool = True) -> Any:
    inten = _shown(grid, name, smoothed)
    G = inten.shape[0]
    edges = np.linspace(0.0, 1.0, G + 1)
    tag = "all" if grid.env is None else str(grid.env)
    # C[y, x]: rows of the mesh are advantage bins, columns delta bins
    mesh = ax.pcolormesh(edges, edges, np.ma.masked_invalid(inten.T), cmap=LANDSCAPE_CMAP, norm=norm,
                         shading="flat", rasterized=True)
    mesh.set_gid(f"intensity-{tag}-{name}")
    if contours:
        dens = smooth_density(np.asarray(grid.density, dtype=float)).T
        if np.ptp(dens) > 0:
            centers = (edges[:-1] + edges[1:]) / 2
            # levels at multiples of the independence density 1/G^2 (ranks make both
            # marginals uniform, so 1x everywhere means the signals are independent)
            base = 1.0 / (G * G)
            levels = [base * m for m in CONTOUR_LEVELS if dens.min() < base * m < dens.max()]
            if levels:
                cs = ax.contour(centers, centers, dens, levels=levels, colors=DENSITY_COLOR,
                                linewidths=0.45, alpha=0.8)
                cs.set_gid(f"density-{tag}")
    if "delta" in zero:
        ax.axvline(zero["delta"], color="black", linestyle=(0, (1, 1.5)), linewidth=0.8, gid=f"zero-delta-{tag}")
    if "advantage" in zero:
        ax.axhline(zero["advantage"], color="black", linestyle=(0, (1, 1.5)), linewidth=0.8, gid=f"zero-advantage-{tag}")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xticks([0, 0.5, 1], ["0", "0.5", "1"])
    ax.set_yticks([0, 0.5, 1], ["0", "0.5", "1"])
    ax.set_xlabel("teacher preference\n(rank of $\\Delta$)")
    ax.set_ylabel("objective support\n(rank of $\\hat{A}$)")
    ax.set_facecolor(EMPTY_COLOR)  # cells without tokens: distinct from low-mass white
    for side in ("top", "right"):
        ax.spines[side].set_visible(True)
    return mesh
