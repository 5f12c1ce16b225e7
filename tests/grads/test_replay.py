"""Exact replay (icsd_audit.grads.replay) and the sketch-vs-exact agreement on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from icsd_audit.grads.compat import cosines, rl_weights, sketch_error_jackknife
from icsd_audit.grads.replay import (
    per_token_gradients,
    replay_cosines,
    select_parameters,
    weighted_gradients,
)
from icsd_audit.grads.sketch import GradientSketcher, shift_response_mask

from .test_sketch import sketch_step, tiny_batch, tiny_llama

pytest.importorskip("transformers")

torch.set_num_threads(1)  # 2 shared cores: a second OpenMP thread is slower here


def _weights(pos: torch.Tensor, seed: int = 0):
    """RL weights a (turn-constant advantages, ratios near 1, flat tokens zeroed) and 4 distillation weightings."""
    g = torch.Generator().manual_seed(seed)
    n = int(pos.sum())
    adv = torch.randn(pos.shape[0], generator=g)[:, None].expand(pos.shape)[pos]
    ratio = 1 + 0.15 * torch.randn(n, generator=g)
    a = rl_weights(adv, ratio)
    trust = torch.rand(n, generator=g, dtype=torch.float64)
    w = torch.stack(
        [trust, trust * (1 + a.clamp_min(0)), trust * torch.sigmoid(3 * a), torch.rand(n, generator=g, dtype=torch.float64)],
        dim=1,
    )
    return a, w


def test_weighted_gradients_are_weighted_sums_of_per_token_gradients():
    model = tiny_llama(seed=0)
    ids, am, resp = tiny_batch(seed=1)
    _, pos = shift_response_mask(ids, resp)
    _, w = _weights(pos)
    per_tok = per_token_gradients(model, ids, pos, attention_mask=am, temperature=0.8)
    full = weighted_gradients(model, ids, pos, w, attention_mask=am, temperature=0.8)
    assert full.shape == (4, sum(p.numel() for _, p in select_parameters(model)))
    expect = w.T @ per_tok  # float32 model: compare relative to the gradients' scale
    torch.testing.assert_close(full, expect, atol=1e-5 * expect.abs().max().item(), rtol=1e-4)
    # per-position (P, B, T) weights give the same gradients as flat (n, P) ones
    per_pos = torch.zeros(4, *pos.shape, dtype=torch.float64)
    per_pos[:, pos] = w.T
    torch.testing.assert_close(weighted_gradients(model, ids, pos, per_pos, attention_mask=am, temperature=0.8), full)
    assert all(p.grad is None for p in model.parameters())


def test_replay_cosines_match_materialised_gradients():
    model = tiny_llama(seed=0)
    ids, am, resp = tiny_batch(seed=1)
    _, pos = shift_response_mask(ids, resp)
    a, w = _weights(pos)
    grads = weighted_gradients(model, ids, pos, torch.cat([a[:, None], w], 1), attention_mask=am)
    r, d = grads[0], grads[1:]
    expect = (d @ r) / (r.norm() * d.norm(dim=1))
    got = replay_cosines(model, ids, pos, a, w, attention_mask=am)
    torch.testing.assert_close(got, expect, atol=1e-10, rtol=0)
    assert replay_cosines(model, ids, pos, a, w[:, 2], attention_mask=am).item() == pytest.approx(expect[2].item(), abs=1e-10)
    # a named subset: all parameters by name give the same as the default
    names = [n for n, _ in select_parameters(model)]
    torch.testing.assert_close(replay_cosines(model, ids, pos, a, w, attention_mask=am, params=names), got)
    with pytest.raises(KeyError):
        replay_cosines(model, ids, pos, a, w, params=["nope.weight"])


def test_identity_sketch_cosines_equal_exact_restricted_cosines():
    """With P = Q = I the factor cosines are exact over the sketched layers' parameters."""
    model = tiny_llama(seed=2)
    ids, am, resp = tiny_batch(seed=3, b=4, t=16)
    _, pos = shift_response_mask(ids, resp)
    a, w = _weights(pos, seed=1)
    res, sk = sketch_step(model, ids, am, resp, 1.0, "targets", projection="identity")
    exact = replay_cosines(model, ids, pos, a, w, attention_mask=am, params=sk.parameter_names())
    torch.testing.assert_close(cosines(res.factors(), a, w), exact, atol=1e-5, rtol=0)


def test_sketch_cosine_agrees_with_exact_within_the_jackknife_error():
    """Gaussian sketch at k = 16 (smaller than every layer dim) vs exact replay over the same parameters.

    The stated error is the jackknife standard error (8 blocks).  Over 12 projection
    seeds x 4 weightings, every deviation is within 4 stated errors, and the spread
    of the deviations matches the stated error within a factor 2.
    """
    model = tiny_llama(seed=0)
    ids, am, resp = tiny_batch(seed=1, b=6, t=24)
    _, pos = shift_response_mask(ids, resp)
    a, w = _weights(pos)
    names = GradientSketcher(model).parameter_names()
    exact = replay_cosines(model, ids, pos, a, w, attention_mask=am, params=names)
    assert exact.abs().max() > 0.2  # a non-trivial target
    errs, ses = [], []
    for seed in range(12):
        res, _ = sketch_step(model, ids, am, resp, 1.0, "targets", k_out=16, k_in=16, seed=seed)
        errs.append(cosines(res.factors(), a, w) - exact)
        ses.append(sketch_error_jackknife(res.factors(), a, w, blocks=8))
    errs, ses = torch.stack(errs), torch.stack(ses)
    assert torch.isfinite(ses).all() and (ses > 0).all()
    assert (errs.abs() <= 4 * ses).all(), (errs / ses)
    ratio = errs.square().mean(0).sqrt() / ses.mean(0)
    assert ((ratio > 0.5) & (ratio < 2.0)).all(), ratio


def test_restricted_cosine_tracks_whole_model_cosine():
    """The sketched-layer cosine is a proxy for the whole-model one; on the tiny model they correlate."""
    model = tiny_llama(seed=0)
    ids, am, resp = tiny_batch(seed=1, b=6, t=24)
    _, pos = shift_response_mask(ids, resp)
    names = GradientSketcher(model).parameter_names()
    restricted, whole = [], []
    for seed in range(4):
        a, w = _weights(pos, seed=seed)
        restricted.append(replay_cosines(model, ids, pos, a, w, attention_mask=am, params=names))
        whole.append(replay_cosines(model, ids, pos, a, w, attention_mask=am))
    x, y = torch.cat(restricted), torch.cat(whole)
    corr = torch.corrcoef(torch.stack([x, y]))[0, 1]
    assert corr > 0.8, (corr, x, y)
