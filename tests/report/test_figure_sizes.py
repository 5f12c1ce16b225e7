"""Figures read well for 1, 2 and 200 steps and 1 to 50 batches (issue 24 item 7).

Checked on the renderer's text bounding boxes, not on pixels: no two texts of a figure
(tick labels, axis labels, titles, legends, annotations) overlap; every batch row of the
alignment figure and every step of a short run has its label; the landscape's multiplier
labels sit outside the panels, off the cells and contours.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

from icsd_audit.report.build import GradcosSummary
from icsd_audit.report.figures import alignment_figure, dynamics_figure, landscape_figure, quadrant_figure, shift_figure
from icsd_audit.stats.api import GroupedResult
from tests.report import figure_fixtures as fx


def texts(fig: Figure) -> list[tuple[str, object]]:
    """(text, window extent) of every text the renderer drew: visible, non-empty, and for tick
    labels only those of ticks inside the axis' view (matplotlib keeps spare ticks off-view)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    off_view = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 * max(1.0, abs(hi - lo)) <= tick.get_loc() <= hi + 1e-9 * max(1.0, abs(hi - lo)):
                    off_view.update({id(tick.label1), id(tick.label2)})
    return [(t.get_text(), t.get_window_extent(renderer)) for t in fig.findobj(Text)
            if t.get_visible() and t.get_text().strip() and id(t) not in off_view]


def overlaps(fig: Figure) -> list[tuple[str, str]]:
    found = []
    for (a, ba), (b, bb) in itertools.combinations(texts(fig), 2):
        inter_w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
        inter_h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
        if inter_w > 0.5 and inter_h > 0.5:  # more than half a pixel each way
            found.append((a, b))
    return found


def per_step(n: int, steps: tuple[int, ...] | None = None) -> GroupedResult:
    rng = np.random.default_rng(n)
    steps = tuple(range(n)) if steps is None else steps
    return GroupedResult("step", steps, tuple(fx.tcm_result(0.6 + 0.05 * rng.normal(), 0.45 + 0.05 * rng.normal(), 100)
                                              for _ in steps))


def cosines(n: int, first_id: int = 1000) -> GradcosSummary:
    rng = np.random.default_rng(n)
    b = rng.normal(0.1, 0.2, n)
    return GradcosSummary(
        base_name="sdar", compare_name="icsd", batch_ids=tuple(range(first_id, first_id + n)), cos_base=tuple(b),
        cos_compare=tuple(b + rng.normal(0.1, 0.05, n)), cos_perm=tuple(b + rng.normal(0.01, 0.05, n)),
        n_permutations=20, mean_base=fx.br(0.152, 0.05, 0.25, unit="batch"),
        mean_compare=fx.br(0.336, 0.22, 0.45, unit="batch"), mean_perm=fx.br(0.174, 0.07, 0.27, unit="batch"),
        gain=fx.br(0.184, 0.16, 0.21, unit="batch"), perm_gain=fx.br(0.022, 0.018, 0.027, unit="batch"),
        pairing_gain=fx.br(0.162, 0.14, 0.19, unit="batch"))


@pytest.mark.parametrize("n", [1, 2, 5, 12, 13, 200])
def test_dynamics_for_short_and_long_runs(n: int) -> None:
    fig = dynamics_figure(per_step(n), show_diff=True)
    assert not overlaps(fig), overlaps(fig)
    lo, hi = fig.axes[-1].get_xlim()
    labels = [t.get_text() for t, x in zip(fig.axes[-1].get_xticklabels(), fig.axes[-1].get_xticks()) if lo <= x <= hi]
    if n <= 12:  # every step its own label, no point on the frame's edge
        assert labels == [str(s) for s in range(n)], labels
        assert lo < 0 and hi > n - 1
    assert fig.get_size_inches()[0] == pytest.approx(3.35)  # a column wide, never a strip in a wide canvas
    main = fig.axes[0].get_window_extent()
    assert main.width > 0.6 * fig.bbox.width, (main.width, fig.bbox.width)
    caption = fig.axes[0].get_legend().get_title().get_text()
    assert ("too few for a 5-step mean" in caption) == (n < 5), caption


def test_dynamics_bunched_steps_keep_their_ticks_apart() -> None:
    steps = (*range(11), 1000)  # 12 points, 11 of them within 1 % of the axis
    fig = dynamics_figure(per_step(12, steps), show_diff=True)
    assert not overlaps(fig), overlaps(fig)
    lo, hi = fig.axes[-1].get_xlim()
    shown = [x for x in fig.axes[-1].get_xticks() if lo <= x <= hi]
    assert len(shown) < 12 and 1000 <= hi < 1100, (shown, hi)  # the locator's ticks, not one per step


@pytest.mark.parametrize("n", [1, 2, 6, 50])
def test_alignment_labels_every_batch(n: int) -> None:
    res = cosines(n)
    fig = alignment_figure(res)
    assert not overlaps(fig), overlaps(fig)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["means", *map(str, res.batch_ids)], labels


@pytest.mark.parametrize("envs", [1, 2])
def test_landscape_multipliers_sit_beside_the_panels(envs: int) -> None:
    from icsd_audit import stats
    from tests.stats.test_api import make_tokens, split_call

    d = make_tokens(8, n_batches=4)
    if envs == 1:
        d = {k: v for k, v in d.items() if k != "env"}
    tokens, weights, _ = split_call(d)
    res = stats.landscape(tokens, weights, env=d.get("env"), grid=10, n_resamples=100, rng=0)
    fig = landscape_figure(res)
    assert not overlaps(fig), overlaps(fig)
    renderer = fig.canvas.get_renderer()
    labels = [t for t in fig.findobj(Text) if str(t.get_gid() or "").startswith("region-label-")]
    assert len(labels) == 2 * 2 * len(res.envs)  # two regions x two weightings per environment
    for t in labels:
        box, panel = t.get_window_extent(renderer), t.axes.get_window_extent(renderer)
        assert box.x0 >= panel.x1, (t.get_text(), box, panel)  # right of the panel, off the data
        for other in fig.axes:  # nor over the next panel or the colour bar
            if other is not t.axes:
                assert not box.overlaps(other.get_window_extent(renderer)), (t.get_text(), box, other)


def test_quadrant_and_shift_figures_have_no_overlapping_text() -> None:
    for fig in (quadrant_figure(fx.quadrants_result(), include_neutral=True), shift_figure(fx.shift_result())):
        assert not overlaps(fig), overlaps(fig)


def _curves(n: int, keys: tuple[str, ...], envs: tuple[str, ...] = ("webshop",)) -> list:
    from icsd_audit.runs.curves import Curve

    rng = np.random.default_rng(n)
    out = []
    for label in ("none", "sdar", "icsd"):
        for env in envs:
            for key in keys:
                m = rng.random(n)
                out.append(Curve(label, env, key, np.arange(n), m, m - 0.1, m + 0.1, np.full(n, 3), 0.95, 1000))
    return out


@pytest.mark.parametrize("n", [1, 2, 200])
def test_compare_figures_for_short_and_long_runs(n: int) -> None:
    from icsd_audit.report.figures.curves import MECHANISM_PANELS, curves_figure, mechanism_figure

    fig = mechanism_figure(_curves(n, tuple(MECHANISM_PANELS)))
    assert not overlaps(fig), overlaps(fig)  # a 200-step run's step ticks ran together ("0 2550751001...")
    widths = [a.get_window_extent().width for a in fig.axes]
    assert min(widths) > 0.9 * max(widths), widths  # the legend no longer widens the first panel alone
    for envs in (("webshop",), ("webshop", "alfworld")):
        fig = curves_figure(_curves(n, ("rollout/success",), envs), "rollout/success")
        assert not overlaps(fig), overlaps(fig)
