"""Scores m of the allocators (SPEC 4-5), each registered as an allocator where it is defined.

``opsd`` and ``sdar`` have no score (c = 1 and c = g); every other allocator keeps the fallback set D and the turn
mass matching of SPEC 4.4 and differs only in the score that enters it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from icsd_audit.alloc.calibration import fit_gaussian, fit_laplace, fit_laplace_centered, normal_cdf, recentred_laplace_cdf_, segment_laplace_cdf_
from icsd_audit.alloc.layout import Layout
from icsd_audit.alloc.registry import AllocatorSpec, Score, allocator, register_allocator
from icsd_audit.alloc.segments import order_key

__all__ = ["calibrated", "shuffle_pairs", "score_icsd", "score_fisher", "score_sign", "score_gaussian", "score_permuted"]

register_allocator(AllocatorSpec("opsd", "uniform", None, "plain OPSD: c = 1 on every valid token"))
register_allocator(AllocatorSpec("sdar", "trust", None, "SDAR: c = g, the base trust"))


def calibrated(x: Tensor, lay: Layout, *, eta: float, eps: float, min_group: int) -> Score:
    """Phi_G(x) with the group -> batch -> fixed-map fallback chain of SPEC 4.2.

    The batch fit is only needed when some group is unusable; otherwise the centred
    values of the group fit are mapped in place.
    """
    order = torch.argsort(order_key(x), stable=True)
    grp, z, below = fit_laplace_centered(x, lay.group, lay.n_groups, eps=eps, min_group=min_group, value_order=order)
    if bool(grp.usable.all()):
        m = segment_laplace_cdf_(z, below, lay.group, lay.n_groups, grp.b_minus, grp.b_plus, eta=eta)
        return Score(m=m)
    bat = fit_laplace(x, lay.batch, lay.n_batches, eps=eps, min_group=min_group, value_order=order)
    # Choose each group's parameters on the (tiny) per-group arrays, then map once.
    gb = lay.group_batch
    batch_ok = bat.usable[gb]
    one = torch.ones_like(grp.mu)
    mu = torch.where(grp.usable, grp.mu, torch.where(batch_ok, bat.mu[gb], 0 * one))
    bm = torch.where(grp.usable, grp.b_minus, torch.where(batch_ok, bat.b_minus[gb], one))
    bp = torch.where(grp.usable, grp.b_plus, torch.where(batch_ok, bat.b_plus[gb], one))
    m = recentred_laplace_cdf_(x, z, lay.group, lay.n_groups, mu, bm, bp, eta=eta)
    return Score(
        m=m,
        groups_batch_stats=int((~grp.usable & batch_ok).sum()),
        groups_fixed_map=int((~grp.usable & ~batch_ok).sum()),
    )


@allocator("icsd", combine="trust-weighted", description="ICSD: m = Phi_G(A*rho*delta), turn mass matched")
@allocator("influence-only", combine="influence-only", description="ICSD with g replaced by 1 inside C")
def score_icsd(*, u: Tensor, advantage: Tensor, ratio: Tensor, lay: Layout, eta: float, eps: float, min_group: int, **_: object) -> Score:
    return calibrated(u, lay, eta=eta, eps=eps, min_group=min_group)


@allocator("fisher", combine="trust-weighted", requires=("score_norm",),
           description="m = Phi_G(|A*rho| * score_norm): unsigned per-token policy-gradient magnitude")
def score_fisher(*, advantage: Tensor, ratio: Tensor, score_norm: Tensor, lay: Layout, eta: float, eps: float,
                  min_group: int, **_: object) -> Score:
    # |A * rho| alone is constant over a turn wherever rho is, and turn mass matching
    # cancels per-turn constants; the per-token score norm is what varies inside a turn.
    return calibrated((advantage * ratio).abs() * score_norm, lay, eta=eta, eps=eps, min_group=min_group)


@allocator("sign", combine="trust-weighted", description="m = 1 / 0.5 / 0 for u > 0 / = 0 / < 0")
def score_sign(*, u: Tensor, **_: object) -> Score:
    return Score(m=(torch.sign(u) + 1.0) / 2.0)


@allocator("gaussian", combine="trust-weighted", description="m = normal CDF of the group z-score of u")
def score_gaussian(*, u: Tensor, lay: Layout, eps: float, min_group: int, **_: object) -> Score:
    grp = fit_gaussian(u, lay.group, lay.n_groups, eps=eps, min_group=min_group)
    bat = fit_gaussian(u, lay.batch, lay.n_batches, eps=eps, min_group=min_group)
    gb = lay.group_batch
    batch_ok = bat.usable[gb]
    one = torch.ones_like(grp.mean)
    mean = torch.where(grp.usable, grp.mean, torch.where(batch_ok, bat.mean[gb], 0 * one))
    std = torch.where(grp.usable, grp.std, torch.where(batch_ok, bat.std[gb], one))
    return Score(
        m=normal_cdf((u - mean[lay.group]) / std[lay.group]),
        groups_batch_stats=int((~grp.usable & batch_ok).sum()),
        groups_fixed_map=int((~grp.usable & ~batch_ok).sum()),
    )


@allocator("permuted", combine="trust-weighted",
           description="ICSD scores shuffled among C tokens of the batch (seeded)")
def score_permuted(*, u: Tensor, fallback: Tensor, lay: Layout, eta: float, eps: float, min_group: int, seed: int, **_: object) -> Score:
    """ICSD scores shuffled uniformly among the C tokens of each batch.

    Random keys come from a CPU generator so a seed means the same shuffle on any
    device.  Sorting C tokens by (batch, key) and by (batch, position) pairs the
    i-th slot of each batch in both orders: a uniform within-batch permutation.
    """
    base = calibrated(u, lay, eta=eta, eps=eps, min_group=min_group)
    src, dst = shuffle_pairs(fallback, lay, seed)
    m = base.m.clone()
    m[dst] = base.m[src]
    return Score(m=m, groups_batch_stats=base.groups_batch_stats, groups_fixed_map=base.groups_fixed_map)


def shuffle_pairs(fallback: Tensor, lay: Layout, seed: int) -> tuple[Tensor, Tensor]:
    """(src, dst) token indices of the seeded within-batch shuffle of the C tokens.

    The score of token ``src[i]`` moves to token ``dst[i]``.  Shared by the
    ``permuted`` allocator and the vectorised permutation controls, so both give the
    same shuffle for the same seed.
    """
    idx = torch.nonzero(~fallback).squeeze(1)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    # Integer keys: radix-sortable, and ties (probability ~n^2/2^63) break by position.
    keys = torch.randint(0, 2**62, (idx.numel(),), generator=gen).to(fallback.device)
    bat = lay.batch[idx]
    by_key = torch.argsort(keys, stable=True)
    src = idx[by_key[torch.argsort(bat[by_key], stable=True)]]
    dst = idx[torch.argsort(bat, stable=True)]
    return src, dst
