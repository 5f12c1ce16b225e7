"""Figures draw exactly the numbers of their result objects (checked on artists, not pixels)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from icsd_audit.report.figures import (
    alignment_figure,
    centered_mean,
    dynamics_figure,
    landscape_figure,
    quadrant_figure,
    render,
    save_figure,
    shift_figure,
    shift_positions,
)
from icsd_audit.report.figures.landscape import CONTOUR_LEVELS, smooth_density
from icsd_audit.report.figures.style import format_pp, new_figure
from tests.report import figure_fixtures as fx

FOUR = ("pos_delta_pos_adv", "pos_delta_neg_adv", "neg_delta_pos_adv", "neg_delta_neg_adv")


def by_gid(fig: Figure, gid: str) -> list:
    return [a for a in fig.findobj() if getattr(a, "get_gid", lambda: None)() == gid]


def segments(fig: Figure, gid: str) -> np.ndarray:
    """All whisker segments of the LineCollections tagged ``gid``: (n, 2, 2)."""
    segs = [np.asarray(s) for c in by_gid(fig, gid) if hasattr(c, "get_segments") for s in c.get_segments()]
    return np.array(segs)


def drawn(fig: Figure) -> Figure:
    assert isinstance(fig.canvas, FigureCanvasAgg)
    fig.canvas.draw()  # must render headless without error
    return fig


# --------------------------------------------------------------------------- quadrants


@pytest.mark.parametrize("neutral", [False, True])
def test_quadrant_bars_whiskers_and_brackets(neutral: bool) -> None:
    res = fx.quadrants_result()
    fig = drawn(quadrant_figure(res, include_neutral=neutral))
    names = FOUR + (("neutral",) if neutral else ())
    for k, side in enumerate(("base", "compare")):
        bars = by_gid(fig, f"bars-{side}")
        assert len(bars) == len(names)
        heights = [b.get_height() for b in bars]
        expected = [100 * fx.QUAD[r][k][0] for r in names]
        np.testing.assert_allclose(heights, expected, rtol=0, atol=1e-12)
        centers = np.array([b.get_x() + b.get_width() / 2 for b in bars])
        seg = segments(fig, f"whiskers-{side}")
        vertical = seg[np.isclose(seg[:, 0, 0], seg[:, 1, 0])]
        assert len(vertical) == len(names)
        np.testing.assert_allclose(vertical[:, 0, 0], centers)
        lows = np.minimum(vertical[:, 0, 1], vertical[:, 1, 1])
        highs = np.maximum(vertical[:, 0, 1], vertical[:, 1, 1])
        np.testing.assert_allclose(lows, [100 * fx.QUAD[r][k][1] for r in names], atol=1e-12)
        np.testing.assert_allclose(highs, [100 * fx.QUAD[r][k][2] for r in names], atol=1e-12)
    texts = {r: [a.get_text() for a in by_gid(fig, f"bracket-{r}") if hasattr(a, "get_text")] for r in names}
    assert texts["pos_delta_pos_adv"] == ["+6.2 pp"]
    assert texts["pos_delta_neg_adv"] == ["\u22127.5 pp"]
    assert texts["neg_delta_pos_adv"] == ["\u22121.5 pp"]
    assert texts["neg_delta_neg_adv"] == ["0 pp"]
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert len(ticks) == len(names)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["SDAR", "ICSD"]


def test_quadrant_figure_draws_into_a_given_axes() -> None:
    fig = new_figure(6, 3)
    a1, a2 = fig.subplots(1, 2)
    out = quadrant_figure(fx.quadrants_result(), ax=a2, legend=False, annotate=False)
    assert out is fig
    assert len(a2.patches) == 8 and len(a1.patches) == 0
    assert not by_gid(fig, "bracket-neutral") and not by_gid(fig, "bracket-pos_delta_pos_adv")


def test_format_pp() -> None:
    assert format_pp(6.24) == "+6.2" and format_pp(-7.46) == "\u22127.5" and format_pp(0.0) == "0"
    assert format_pp(-0.04) == "0"


# --------------------------------------------------------------------------- landscape


def test_landscape_meshes_are_the_transposed_intensities() -> None:
    res = fx.landscape_result(two_envs=True)
    fig = drawn(landscape_figure(res))
    panels = [a for a in fig.axes if a.get_label() != "<colorbar>"]
    assert len(panels) == 4  # 2 environments x (base, compare)
    for env, grid in res.envs.items():
        for name in ("sdar", "icsd"):
            (mesh,) = by_gid(fig, f"intensity-{env}-{name}")
            arr = mesh.get_array()
            want = grid.intensity[name].T
            assert np.ma.is_masked(arr) and arr.mask.tolist() == np.isnan(want).tolist()
            np.testing.assert_array_equal(arr.filled(np.nan), want)
            assert mesh.norm.vcenter == 1.0 and mesh.norm.vmin == 0.0
            # one shared colour scale across all panels, topped by the largest intensity
            assert mesh.norm.vmax == pytest.approx(2.9 + 1)
        vlines, hlines = by_gid(fig, f"zero-delta-{env}"), by_gid(fig, f"zero-advantage-{env}")
        assert len(vlines) == len(hlines) == 2  # one per panel of the environment
        assert all(v.get_xdata()[0] == grid.zero_rank["delta"] for v in vlines)
        assert all(h.get_ydata()[0] == grid.zero_rank["advantage"] for h in hlines)
        sets = by_gid(fig, f"density-{env}")
        smooth = smooth_density(grid.density)
        assert len(sets) == 2 and all(len(cs.levels) >= 1 for cs in sets)
        for level in sets[0].levels:  # multiples of the independence density 1/G^2, inside the data range
            assert level * 9 == pytest.approx(min(CONTOUR_LEVELS, key=lambda m: abs(m - level * 9)))
            assert smooth.min() < level < smooth.max()
    titles = [a.get_title(loc="left") for a in panels]
    assert titles == ["(a) alfworld\nSDAR", "(b) alfworld\nICSD", "(c) webshop\nSDAR", "(d) webshop\nICSD"]


def test_smooth_density_by_hand() -> None:
    d = np.zeros((3, 3))
    d[1, 1] = 1.0
    # separable [1, 2, 1] / 4 with mirrored edges: centre 1/4, edge neighbours 1/8, corners 1/16
    want = np.outer([0.5, 1.0, 0.5], [0.5, 1.0, 0.5]) / 4
    np.testing.assert_allclose(smooth_density(d), want)
    rng = np.random.default_rng(0)
    r = rng.random((6, 6))
    assert smooth_density(r).sum() == pytest.approx(r.sum())  # mass preserved
    assert smooth_density(np.ones((2, 5))).shape == (2, 5)  # too small to smooth: returned as is


def test_landscape_single_env_compare_only_with_explicit_zero_ranks() -> None:
    res = fx.landscape_result(two_envs=False)
    fig = drawn(landscape_figure(res, weightings=("compare",), zero_ranks={None: {"delta": 0.25}}, colorbar=False))
    assert len(fig.axes) == 1
    (mesh,) = by_gid(fig, "intensity-all-icsd")
    np.testing.assert_array_equal(mesh.get_array().filled(np.nan), res.envs[None].intensity["icsd"].T)
    (vline,) = by_gid(fig, "zero-delta-all")
    assert vline.get_xdata()[0] == 0.25
    assert not by_gid(fig, "zero-advantage-all")  # the explicit mapping replaces the grid's own
    assert fig.axes[0].get_xlim() == (0.0, 1.0) and fig.axes[0].get_ylim() == (0.0, 1.0)


def test_landscape_rejects_unknown_weighting_and_axes_count() -> None:
    res = fx.landscape_result(two_envs=False)
    with pytest.raises(ValueError, match="weighting"):
        landscape_figure(res, weightings=("fisher",))
    fig = new_figure()
    with pytest.raises(ValueError, match="2 panel"):
        landscape_figure(res, ax=fig.subplots(1, 1))


# --------------------------------------------------------------------------- share shift


def test_shift_points_and_whiskers() -> None:
    res = fx.shift_result()
    fig = drawn(shift_figure(res))
    pos = shift_positions(5)
    signed = [k for k in fx.SHIFT if k != "zero" and fx.SHIFT[k][1] > 0]
    (line,) = [a for a in by_gid(fig, "shift-signed") if hasattr(a, "get_xdata")]
    np.testing.assert_allclose(line.get_xdata(), [pos[k] for k in signed])
    np.testing.assert_allclose(line.get_ydata(), [100 * fx.SHIFT[k][0][0] for k in signed], atol=1e-12)
    seg = segments(fig, "shift-signed")
    np.testing.assert_allclose(seg[:, 0, 0], [pos[k] for k in signed])
    np.testing.assert_allclose(np.sort(seg[:, :, 1], axis=1),
                               [[100 * fx.SHIFT[k][0][1], 100 * fx.SHIFT[k][0][2]] for k in signed], atol=1e-12)
    (zero,) = [a for a in by_gid(fig, "shift-zero") if hasattr(a, "get_xdata")]
    assert zero.get_xdata().tolist() == [pos["zero"]]
    assert zero.get_ydata()[0] == pytest.approx(100 * 0.001)
    # the zero bin sits apart: strictly between the sides, at least one unit from each
    assert pos["neg_5"] + 1 <= pos["zero"] <= pos["pos_1"] - 1
    assert fig.axes[0].get_ylabel() == "share shift, ICSD \u2212 SDAR (pp)"


# --------------------------------------------------------------------------- gradient alignment


def test_alignment_flows_means_and_gains() -> None:
    res = fx.gradcos_summary(perm=True)
    fig = drawn(alignment_figure(res))
    assert len(fig.axes) == 3
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["means", "0", "1", "2", "3", "4"]  # every row
    for gid, key in (("cos-base-a", "base"), ("cos-compare-a", "compare"), ("cos-base-b", "base"), ("cos-perm-b", "perm")):
        (line,) = by_gid(fig, gid)
        np.testing.assert_array_equal(line.get_xdata(), fx.COS[key])
        np.testing.assert_array_equal(line.get_ydata(), [4, 3, 2, 1, 0])  # batch 1 on top
    for gid, mean in (("mean-base-a", res.mean_base), ("mean-compare-a", res.mean_compare), ("mean-perm-b", res.mean_perm)):
        (pt,) = [a for a in by_gid(fig, gid) if hasattr(a, "get_xdata")]
        assert pt.get_xdata()[0] == mean.estimate
        seg = segments(fig, gid)
        assert sorted(seg[0, :, 0]) == pytest.approx([mean.ci_low, mean.ci_high])
    seg = segments(fig, "gains")
    want = [(res.gain.ci_low, res.gain.ci_high), (res.perm_gain.ci_low, res.perm_gain.ci_high),
            (res.pairing_gain.ci_low, res.pairing_gain.ci_high)]
    np.testing.assert_allclose(np.sort(seg[:, :, 0], axis=1), want)
    (pts,) = by_gid(fig, "gains-points")
    np.testing.assert_allclose(pts.get_offsets()[:, 0], [res.gain.estimate, res.perm_gain.estimate, res.pairing_gain.estimate])


def test_alignment_without_permutation_control() -> None:
    res = fx.gradcos_summary(perm=False)
    fig = drawn(alignment_figure(res))
    assert len(fig.axes) == 2  # flow (a) and the gains forest
    assert not by_gid(fig, "cos-perm-b")
    seg = segments(fig, "gains")
    assert len(seg) == 1 and sorted(seg[0, :, 0]) == pytest.approx([res.gain.ci_low, res.gain.ci_high])
    fig2 = drawn(alignment_figure(res, gains=False))
    assert len(fig2.axes) == 1


# --------------------------------------------------------------------------- dynamics


def _slow_centered_mean(steps, values, window):
    out = []
    for s in steps:
        near = [v for t, v in zip(steps, values) if abs(t - s) <= window // 2 and v == v]
        out.append(sum(near) / len(near) if near else float("nan"))
    return out


def test_centered_mean_by_hand() -> None:
    steps = [0, 1, 2, 3, 4, 5, 7, 8]
    vals = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, float("nan")]
    got = centered_mean(steps, vals, 5)
    # step 0: steps 0..2 -> (1+2+3)/3; step 5: steps 3,4,5,7 -> 23/4; step 8: steps 7 (8 is NaN) -> 8
    assert got[0] == pytest.approx(2.0) and got[5] == pytest.approx(23 / 4) and got[7] == pytest.approx(8.0)
    np.testing.assert_allclose(got, _slow_centered_mean(steps, vals, 5))
    np.testing.assert_allclose(centered_mean(steps, vals[:-1] + [0.0], 1), vals[:-1] + [0.0])


def test_dynamics_lines_follow_step_order() -> None:
    res = fx.dynamics_result()
    fig = drawn(dynamics_figure(res, show_diff=True))
    steps = sorted(fx.STEPS)
    for k, side in enumerate(("base", "compare")):
        (pale,) = by_gid(fig, f"step-{side}")
        (dark,) = by_gid(fig, f"mean-{side}")
        y = [100 * fx.STEPS[s][k] for s in steps]
        np.testing.assert_array_equal(pale.get_xdata(), steps)
        np.testing.assert_allclose(pale.get_ydata(), y)
        np.testing.assert_allclose(dark.get_ydata(), _slow_centered_mean(steps, y, 5))
        assert dark.get_linewidth() > pale.get_linewidth() and pale.get_alpha() < 1
    (diff,) = by_gid(fig, "diff-step")
    np.testing.assert_allclose(diff.get_ydata(), [100 * (fx.STEPS[s][1] - fx.STEPS[s][0]) for s in steps])
    (band,) = by_gid(fig, "diff-ci")
    verts = band.get_paths()[0].vertices
    d = np.array([100 * (fx.STEPS[s][1] - fx.STEPS[s][0]) for s in steps])
    assert verts[:, 1].min() == pytest.approx((d - 0.3).min()) and verts[:, 1].max() == pytest.approx((d + 0.3).max())
    assert len(fig.axes) == 2


def test_dynamics_of_a_quadrant_region() -> None:
    q = fx.quadrants_result()
    grouped = fx.GroupedResult("step", (10, 20), (q, q))
    fig = drawn(dynamics_figure(grouped, region="pos_delta_neg_adv", window=3))
    (pale,) = by_gid(fig, "step-compare")
    np.testing.assert_allclose(pale.get_ydata(), [100 * 0.275] * 2)


# --------------------------------------------------------------------------- headless, files


def test_importing_figures_leaves_pyplot_and_the_backend_alone() -> None:
    code = textwrap.dedent("""
        import sys, matplotlib
        matplotlib.use("svg")
        import icsd_audit.report.figures as F
        from tests.report import figure_fixtures as fx
        fig = F.quadrant_figure(fx.quadrants_result())
        F.render(fig, "png")
        assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
        assert "matplotlib.pyplot" not in sys.modules
        print("ok")
    """)
    env = {**os.environ, "MPLBACKEND": ""}
    env.pop("DISPLAY", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("fmt,magic", [("png", b"\x89PNG"), ("pdf", b"%PDF"), ("svg", b"<?xml")])
def test_save_figure_formats_atomically(tmp_path, fmt: str, magic: bytes) -> None:
    fig = shift_figure(fx.shift_result())
    path = save_figure(fig, tmp_path / f"shift.{fmt}", dpi=80)
    assert path.read_bytes().startswith(magic)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"shift.{fmt}"]  # no temporary left behind
    if fmt != "png":  # no timestamps: the same result renders to the same bytes
        assert render(fig, fmt) == render(fig, fmt)


def test_quadrant_figure_rejects_empty_result() -> None:
    res = fx.quadrants_result()
    empty = type(res)(**{**res.__dict__, "regions": {}})
    with pytest.raises(ValueError, match="none of the four"):
        quadrant_figure(empty)


def test_landscape_draws_smoothed_intensity_and_region_outlines() -> None:
    from icsd_audit import stats
    from tests.stats.test_api import make_tokens, split_call

    d = make_tokens(8, n_batches=4)
    tokens, weights, _ = split_call(d)
    res = stats.landscape(tokens, weights, env=d["env"], grid=6, n_resamples=200, rng=0)
    fig = drawn(landscape_figure(res))
    for env, g in res.envs.items():
        (mesh,) = by_gid(fig, f"intensity-{env}-icsd")
        np.testing.assert_array_equal(mesh.get_array().filled(np.nan), g.smoothed["icsd"].T)
        for name, r in g.regions.items():
            for rect in by_gid(fig, f"region-{name}-{env}-icsd"):
                assert rect.get_x() >= 0.8 - 1e-12
    # the raw intensity when asked
    fig = drawn(landscape_figure(res, smoothed=False, regions=False))
    env, g = next(iter(res.envs.items()))
    (mesh,) = by_gid(fig, f"intensity-{env}-sdar")
    np.testing.assert_array_equal(mesh.get_array().filled(np.nan), g.intensity["sdar"].T)
    assert not any(by_gid(fig, f"region-{n}-{env}-sdar") for n in g.regions)


# --------------------------------------------------------------------------- short runs (issue 15)


def test_short_run_dynamics_has_integer_ticks_and_says_the_window_is_longer() -> None:
    q = fx.quadrants_result()
    fig = drawn(dynamics_figure(fx.GroupedResult("step", (0, 1), (q, q)), region="pos_delta_neg_adv", window=5))
    ticks = [t for t in fig.axes[-1].get_xticks() if -0.5 <= t <= 1.5]
    assert ticks == [0, 1], ticks  # was 0.0, 0.2, ... 1.0
    title = fig.axes[0].get_legend().get_title().get_text()
    assert title == "per step (2 steps: too few for a 5-step mean)"
    assert not by_gid(fig, "mean-compare")  # no flat 'mean' line over a run shorter than the window


def test_window_caption_by_run_length() -> None:
    from icsd_audit.report.figures.dynamics import window_caption

    assert window_caption(np.arange(10.0), 5) == "pale: per step; dark: centred 5-step mean"
    assert window_caption(np.arange(5.0), 5) == "pale: per step; dark: centred 5-step mean"
    assert window_caption(np.arange(4.0), 5) == "per step (4 steps: too few for a 5-step mean)"
    assert window_caption(np.arange(1.0), 5) == "per step (1 step: too few for a 5-step mean)"
