"""The token-strata figure draws the result object's numbers (SPEC 11), nothing else."""

from __future__ import annotations

import numpy as np

from icsd_audit import Tokens, Weights, strata
from icsd_audit.report.figures import strata_figure


def _result():
    rng = np.random.default_rng(2)
    n_turns, per = 30, 10
    n = n_turns * per
    turn_of = np.repeat(np.arange(n_turns), per)
    t = Tokens(advantage=np.repeat(rng.choice([-1.0, 1.0], n_turns), per), ratio=np.ones(n), delta=rng.normal(size=n),
               traj_id=turn_of, turn_id=np.zeros(n, dtype=np.int64), batch_id=turn_of // 10)
    x = t.delta.copy()  # the lowest bins hold delta <= 0 only: their TCM is n/a and must not be drawn
    return strata(t, Weights(rng.uniform(0.1, 1, n), rng.uniform(0, 2, n)), by="abs_delta", x=x, bins=4,
                  n_resamples=100, rng=0)


def _line(fig, gid):
    return [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid() == gid]


def test_strata_figure_plots_the_result() -> None:
    res = _result()
    fig = strata_figure(res)
    assert len(fig.axes) == 2
    for side in ("base", "compare"):
        (share,) = _line(fig, f"share-{side}")
        want = [100 * getattr(b.share, side).estimate for b in res.bins]
        assert np.allclose(share.get_ydata(), want)
        (tcm,) = _line(fig, f"tcm-{side}")
        defined = [b for b in res.bins if b.tcm_undefined is None]
        assert 0 < len(defined) < len(res.bins)
        assert np.allclose(tcm.get_ydata(), [100 * getattr(b.tcm, side).estimate for b in defined])
    tok = [c for c in fig.axes[0].collections if c.get_gid() == "token-share"][0]
    assert np.allclose(tok.get_offsets()[:, 1], [100 * b.token_share.estimate for b in res.bins])
