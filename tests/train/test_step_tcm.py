"""The step's logged TCM (metrics.jsonl ``alloc/tcm``): pooled over the step's mini-batches, absent when undefined."""

from __future__ import annotations

import numpy as np

from icsd_audit.train.run.metrics import step_tcm


def _arrays(delta, advantage, c, g, batch):
    n = len(delta)
    return {"delta": np.asarray(delta, float), "advantage": np.asarray(advantage, float), "ratio": np.ones(n),
            "g": np.asarray(g, float), "c": np.asarray(c, float), "traj_id": np.arange(n), "turn_id": np.zeros(n, int),
            "batch_id": np.asarray(batch, int)}


def test_the_tcm_pools_every_mini_batch_of_the_step_even_when_the_last_has_no_active_token():
    # batch 0: an active conflict token (delta > 0, A < 0; mass c 0.3, g 0.6) and an active agreeing one
    # (delta > 0, A > 0; c 0.1, g 0.2); batch 1 (the last): delta 0 everywhere, so no active token
    a = _arrays(delta=[0.5, 0.2, 0.0, 0.0], advantage=[-1.0, 1.0, 1.0, -1.0], c=[0.3, 0.1, 0.4, 0.4],
                g=[0.6, 0.2, 0.4, 0.4], batch=[0, 0, 1, 1])
    out = step_tcm(a)
    assert out["tcm_active_tokens"] == 2.0
    assert np.isclose(out["tcm"], 0.3 / (0.3 + 0.1)) and np.isclose(out["tcm_trust"], 0.6 / (0.6 + 0.2))


def test_a_step_without_an_active_token_logs_no_tcm_rather_than_nan():
    # a policy sure of every token: student and teacher log-probs both 0, so delta is 0 on every token
    a = _arrays(delta=[0.0, 0.0, 0.0], advantage=[1.0, -1.0, 0.5], c=[0.4, 0.4, 0.4], g=[0.4, 0.4, 0.4],
                batch=[0, 0, 1])
    out = step_tcm(a)
    assert "tcm" not in out and "tcm_trust" not in out
    assert out["tcm_active_tokens"] == 0.0
    assert out["share/neutral"] == 1.0  # the region shares stay defined: all the mass is neutral
