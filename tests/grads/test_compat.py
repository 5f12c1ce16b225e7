"""Gradient-compatibility maths (icsd_audit.grads.compat): RL weights, cosines, jackknife sketch error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from icsd_audit.grads.compat import (
    as_source,
    cosines,
    direction_sketch,
    factors_from_columns,
    inner_products,
    jackknife_replicates,
    jackknife_se,
    rl_weights,
    sketch_error_jackknife,
    surrogate_flat,
)
from icsd_audit.grads.sketch import projection_matrix

torch.set_num_threads(1)  # 2 shared cores: a second OpenMP thread is slower here


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_factors(n=200, dims=((7, 5), (4, 9), (6, 6)), seed=0):
    g = _gen(seed)
    return {f"layer{i}": (torch.randn(n, a, generator=g, dtype=torch.float64), torch.randn(n, b, generator=g, dtype=torch.float64)) for i, (a, b) in enumerate(dims)}


def khatri_rao_dense(factors):
    """The materialised per-token sketches: row t = concat_l vec(U_l[t] outer V_l[t])."""
    return torch.cat([torch.einsum("ti,tj->tij", u, v).reshape(u.shape[0], -1) for u, v in factors.values()], dim=1)


# --------------------------------------------------------------------------- RL weights


def test_surrogate_flat_rule_and_rl_weights():
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0, 0.0, 2.0, -0.5])
    ratio = torch.tensor([1.2, 1.2001, 0.5, 0.8, 0.7999, 3.0, 3.01, 5.0, 1.0, 1.1])
    flat = surrogate_flat(adv, ratio)
    assert flat.tolist() == [False, True, False, False, True, False, True, False, False, False]
    valid = torch.ones(10, dtype=torch.bool)
    valid[-1] = False
    a = rl_weights(adv, ratio, valid)
    expected = torch.where(flat | ~valid, torch.zeros(10, dtype=torch.float64), (adv * ratio).double())
    torch.testing.assert_close(a, expected)
    assert a.dtype == torch.float64
    # other clip constants are honoured
    assert surrogate_flat(torch.tensor([1.0]), torch.tensor([1.15]), clip_eps=0.1).item()
    assert not surrogate_flat(torch.tensor([-1.0]), torch.tensor([3.5]), dual_clip=4.0).item()


# --------------------------------------------------------------------------- cosines


def test_dense_cosines_match_independent_numpy():
    rng = np.random.default_rng(0)
    n, k, p = 500, 64, 23
    g = rng.standard_normal((n, k)).astype(np.float32)
    a = rng.standard_normal(n)
    w = rng.random((n, p))
    got = cosines(g, a, w).numpy()
    g64 = g.astype(np.float64)
    r = g64.T @ a
    expect = np.array([(r @ (g64.T @ w[:, j])) / (np.linalg.norm(r) * np.linalg.norm(g64.T @ w[:, j])) for j in range(p)])
    np.testing.assert_allclose(got, expect, rtol=0, atol=1e-12)
    assert cosines(torch.as_tensor(g), torch.as_tensor(a), torch.as_tensor(w[:, 3])).item() == pytest.approx(expect[3], abs=1e-12)


@pytest.mark.parametrize("method", ["direct", "gram", "auto"])
def test_factor_cosines_equal_materialised_dense(method):
    fac = random_factors()
    dense = khatri_rao_dense(fac)
    g = _gen(1)
    a = torch.randn(200, generator=g, dtype=torch.float64)
    w = torch.rand(200, 11, generator=g, dtype=torch.float64)
    torch.testing.assert_close(cosines(fac, a, w, method=method), cosines(dense, a, w), atol=1e-12, rtol=0)
    rd, rr, dd = inner_products(fac, a, w, method=method)
    rd2, rr2, dd2 = inner_products(dense, a, w)
    torch.testing.assert_close(rd, rd2)
    torch.testing.assert_close(rr, rr2)
    torch.testing.assert_close(dd, dd2)
    # float32 compute stays well inside 1e-4
    c32 = cosines({k: (u.float(), v.float()) for k, (u, v) in fac.items()}, a, w, method=method, dtype=torch.float32)
    assert (c32.double() - cosines(dense, a, w)).abs().max() < 1e-5


def test_gram_in_row_blocks_equals_direct():
    fac = random_factors(n=130)
    a = torch.randn(130, dtype=torch.float64, generator=_gen(2))
    w = torch.rand(130, 5, dtype=torch.float64, generator=_gen(3))
    torch.testing.assert_close(
        cosines(fac, a, w, method="gram", row_chunk=17), cosines(fac, a, w, method="direct", chunk=2), atol=1e-13, rtol=0
    )


def test_direction_sketch_is_the_weighted_sum():
    fac = random_factors(n=50)
    w = torch.rand(50, dtype=torch.float64, generator=_gen(4))
    d = direction_sketch(fac, w)
    for name, (u, v) in fac.items():
        torch.testing.assert_close(d[name], sum(w[t] * torch.outer(u[t], v[t]) for t in range(50)))
    dense = khatri_rao_dense(fac)
    torch.testing.assert_close(direction_sketch(dense, w), torch.cat([d[k].reshape(-1) for k in fac]))
    wp = torch.rand(50, 3, dtype=torch.float64, generator=_gen(5))
    assert direction_sketch(fac, wp)["layer0"].shape == (3, 7, 5)
    assert direction_sketch(dense, wp).shape == (3, dense.shape[1])


def test_cosines_are_invariant_to_token_order_and_scale():
    fac = random_factors(n=80)
    a = torch.randn(80, dtype=torch.float64, generator=_gen(6))
    w = torch.rand(80, 4, dtype=torch.float64, generator=_gen(7))
    perm = torch.randperm(80, generator=_gen(8))
    shuffled = {k: (u[perm], v[perm]) for k, (u, v) in fac.items()}
    torch.testing.assert_close(cosines(shuffled, a[perm], w[perm]), cosines(fac, a, w))
    torch.testing.assert_close(cosines(fac, 3.0 * a, 0.5 * w), cosines(fac, a, w))


def test_degenerate_directions_give_nan():
    fac = random_factors(n=20)
    c = cosines(fac, torch.zeros(20), torch.rand(20, 2))
    assert torch.isnan(c).all()
    w = torch.rand(20, 2, dtype=torch.float64)
    w[:, 1] = 0
    c = cosines(fac, torch.randn(20), w)
    assert not torch.isnan(c[0]) and torch.isnan(c[1])


def test_bad_inputs_raise():
    fac = random_factors(n=20)
    with pytest.raises(ValueError):
        cosines(fac, torch.randn(19), torch.rand(20, 2))
    with pytest.raises(ValueError):
        cosines(fac, torch.randn(20), torch.full((20, 2), float("nan")))
    with pytest.raises(ValueError):
        as_source({"x": (torch.randn(20, 3), torch.randn(21, 3))})
    with pytest.raises(ValueError):
        cosines(torch.randn(20), torch.randn(20), torch.rand(20, 2))


def test_factors_from_columns():
    cols = {
        "sketch.lm_head.out": np.ones((4, 3), np.float32),
        "sketch.lm_head.in": np.zeros((4, 2), np.float32),
        "sketch.model.layers.1.mlp.down_proj.out": [[1.0, 2.0]] * 4,
        "sketch.model.layers.1.mlp.down_proj.in": [[1.0]] * 4,
        "advantage": np.zeros(4),
    }
    fac = factors_from_columns(cols)
    assert list(fac) == ["lm_head", "model.layers.1.mlp.down_proj"]
    assert fac["model.layers.1.mlp.down_proj"][0].shape == (4, 2)
    del cols["sketch.lm_head.in"]
    with pytest.raises(ValueError):
        factors_from_columns(cols)


# --------------------------------------------------------------------------- jackknife


def test_jackknife_replicates_equal_explicit_sub_sketches():
    fac = random_factors(n=60, dims=((8, 8), (12, 6)))
    a = torch.randn(60, dtype=torch.float64, generator=_gen(9))
    w = torch.rand(60, 3, dtype=torch.float64, generator=_gen(10))
    blocks = 4
    rep = jackknife_replicates(fac, a, w, blocks=blocks)
    assert rep.shape == (blocks, 3)
    for b in range(blocks):
        sub = {}
        for name, (u, v) in fac.items():
            keep1 = torch.cat([ix for i, ix in enumerate(torch.tensor_split(torch.arange(u.shape[1]), blocks)) if i != b])
            keep2 = torch.cat([ix for i, ix in enumerate(torch.tensor_split(torch.arange(v.shape[1]), blocks)) if i != b])
            scale = math.sqrt(u.shape[1] * v.shape[1] / (len(keep1) * len(keep2)))
            sub[name] = (u[:, keep1] * scale, v[:, keep2])
        torch.testing.assert_close(rep[b], cosines(sub, a, w), atol=1e-12, rtol=0)
    dense = torch.randn(60, 20, dtype=torch.float64, generator=_gen(11))
    rep_d = jackknife_replicates(dense, a, w, blocks=5)
    for b in range(5):
        keep = torch.cat([ix for i, ix in enumerate(torch.tensor_split(torch.arange(20), 5)) if i != b])
        torch.testing.assert_close(rep_d[b], cosines(dense[:, keep], a, w), atol=1e-12, rtol=0)
    se = jackknife_se(rep)
    torch.testing.assert_close(se, torch.sqrt((blocks - 1) / blocks * (rep - rep.mean(0)).square().sum(0)))
    torch.testing.assert_close(sketch_error_jackknife(fac, a, w, blocks=blocks), se)


def _synthetic_problem(n=120, d_out=60, d_in=40, layers=2, seed=0):
    """True per-token factors (g_t, x_t) with shared structure, RL and distillation weights."""
    g = _gen(seed)
    true = []
    for _ in range(layers):
        base_g = torch.randn(3, d_out, generator=g, dtype=torch.float64)
        base_x = torch.randn(3, d_in, generator=g, dtype=torch.float64)
        coef = torch.randn(n, 3, generator=g, dtype=torch.float64)
        gt = coef @ base_g + 0.7 * torch.randn(n, d_out, generator=g, dtype=torch.float64)
        xt = coef.abs() @ base_x + 0.7 * torch.randn(n, d_in, generator=g, dtype=torch.float64)
        true.append((gt, xt))
    a = torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.stack([torch.rand(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64) + 0.8 * a.clamp_min(0)], 1)
    return true, a, w


def _sketch(true, k, seed):
    out = {}
    for i, (gt, xt) in enumerate(true):
        p = projection_matrix("gaussian", k, gt.shape[1], seed * 1000 + 2 * i).double()
        q = projection_matrix("gaussian", k, xt.shape[1], seed * 1000 + 2 * i + 1).double()
        out[f"l{i}"] = (gt @ p.T, xt @ q.T)
    return out


def test_jackknife_error_is_finite_shrinks_with_k_and_covers_the_truth():
    true, a, w = _synthetic_problem()
    exact = cosines({f"l{i}": f for i, f in enumerate(true)}, a, w)
    ses = {}
    errs = {}
    for k in (8, 32, 128):
        se_k, err_k = [], []
        for seed in range(12):
            sk = _sketch(true, k, seed)
            se = sketch_error_jackknife(sk, a, w, blocks=8)
            assert torch.isfinite(se).all() and (se > 0).all()
            se_k.append(se)
            err_k.append(cosines(sk, a, w) - exact)
        ses[k] = torch.stack(se_k).mean(0)
        errs[k] = torch.stack(err_k)
    # the stated error shrinks with k ...
    assert (ses[8] > ses[32]).all() and (ses[32] > ses[128]).all()
    # ... and is the right size: the actual spread of sketch errors is within a factor 2.5 of it
    for k in (32, 128):
        rms = errs[k].square().mean(0).sqrt()
        ratio = rms / ses[k]
        assert ((ratio > 0.4) & (ratio < 2.5)).all(), (k, ratio)
