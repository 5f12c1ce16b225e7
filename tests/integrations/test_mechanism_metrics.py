"""The verl plug-in's per-step mechanism metrics equal the audit's statistics on the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icsd_audit.integrations.core import allocate_padded, mechanism_metrics, mechanism_sums
from icsd_audit.stats.api import quadrants, tcm
from icsd_audit.tokens import Tokens, Weights


def _batch(seed: int, b: int = 12, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(b, generator=g).round(decimals=1)  # some exact zeros: the neutral region is not empty
    delta = torch.randn(b, t, generator=g, dtype=torch.float64)
    delta[0, :3] = 0.0
    mask = torch.rand(b, t, generator=g) > 0.2
    return adv, delta, mask


def test_pooled_metrics_equal_the_audit_on_the_same_tokens():
    sums: dict[str, float] = {}
    flat: dict[str, list[np.ndarray]] = {k: [] for k in ("adv", "delta", "g", "c", "traj")}
    fallback = tokens = 0.0
    for k in range(2):  # two mini-batches pooled by adding their sums
        adv, delta, mask = _batch(k)
        a = allocate_padded(advantage=adv, ratio=1.0, delta=delta, response_mask=mask, traj_id=torch.arange(12) + 100 * k,
                            turn_id=torch.zeros(12, dtype=torch.long), min_group=4)
        for key, v in mechanism_sums(a, adv, delta, mask).items():
            sums[key] = sums.get(key, 0.0) + v
        m = mask.numpy()
        flat["adv"].append(np.broadcast_to(adv.numpy()[:, None], m.shape)[m])
        flat["delta"].append(delta.numpy()[m])
        flat["g"].append(a.g.numpy()[m])
        flat["c"].append(a.c.numpy()[m])
        flat["traj"].append(np.broadcast_to((np.arange(12) + 100 * k)[:, None], m.shape)[m])
        fallback += a.diagnostics.fallback_share * m.sum()
        tokens += m.sum()
    f = {k: np.concatenate(v) for k, v in flat.items()}
    toks = Tokens(advantage=f["adv"].astype(np.float64), ratio=np.ones(f["adv"].size), delta=f["delta"],
                  traj_id=f["traj"], turn_id=np.zeros(f["adv"].size, dtype=np.int64),
                  batch_id=(f["traj"] >= 100).astype(np.int64))
    w = Weights(f["g"], f["c"])
    got = mechanism_metrics(sums)
    t = tcm(toks, w, n_resamples=1, rng=0)
    q = quadrants(toks, w, n_resamples=1, rng=0)
    assert got["icsd/tcm"] == pytest.approx(t.compare.estimate, rel=1e-12)
    assert got["icsd/tcm_sdar"] == pytest.approx(t.base.estimate, rel=1e-12)
    for region, p in q.regions.items():
        assert got[f"icsd/share/{region}"] == pytest.approx(p.compare.estimate, rel=1e-12, abs=1e-15), region
        assert got[f"icsd/share_sdar/{region}"] == pytest.approx(p.base.estimate, rel=1e-12, abs=1e-15), region
    assert got["icsd/share/neutral"] > 0
    assert got["icsd/c_mass"] == pytest.approx(f["c"].sum()) and got["icsd/g_mass"] == pytest.approx(f["g"].sum())
    assert got["icsd/c_mass"] == pytest.approx(got["icsd/g_mass"], rel=1e-9)  # turn mass matching (SPEC 4)
    assert got["icsd/fallback_share"] == pytest.approx(fallback / tokens)
