"""The asymmetric Laplace map of SPEC section 2, fitted per segment.

SDAR's trust map and ICSD's influence calibration are the same family: a median
location and two one-sided mean absolute deviations, each floored at ``eps``.  A
fit is *usable* when its segment holds at least ``min_group`` values and at least
one raw scale exceeds ``eps``; callers chain fallbacks (group -> batch -> fixed map)
on that flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from icsd_audit.alloc.segments import segment_count, segment_mean, segment_median, segment_std, segment_sum, select

__all__ = ["LaplaceFit", "fit_laplace", "fit_laplace_centered", "laplace_cdf", "segment_laplace_cdf_", "recentred_laplace_cdf_", "GaussianFit", "fit_gaussian", "normal_cdf"]


@dataclass(frozen=True)
class LaplaceFit:
    """Per-segment parameters of the asymmetric Laplace map (one entry per segment)."""

    mu: Tensor
    b_minus: Tensor
    b_plus: Tensor
    usable: Tensor
    count: Tensor


def fit_laplace(
    x: Tensor, ids: Tensor, n: int, *, eps: float, min_group: int, value_order: Tensor | None = None
) -> LaplaceFit:
    """Fit SPEC section 2 on each segment of ``x``.

    The raw scales are means over each side of the median (an empty side gives 0
    before flooring), so ``b = max(raw, eps)``; usability is judged on the raw scales.
    """
    return fit_laplace_centered(x, ids, n, eps=eps, min_group=min_group, value_order=value_order)[0]


def fit_laplace_centered(
    x: Tensor, ids: Tensor, n: int, *, eps: float, min_group: int, value_order: Tensor | None = None,
) -> tuple[LaplaceFit, Tensor, Tensor]:
    """:func:`fit_laplace`, also returning ``z = x - mu[ids]`` and the mask ``z < 0``.

    The centred values are what the CDF needs next, so callers map them in place
    (:func:`segment_laplace_cdf_`) instead of recomputing them.  The one-sided sums
    are sums of ``min(z, 0)`` and ``max(z, 0)``: the same values as summing
    ``mu - x`` below and ``x - mu`` at or above the median, in fewer passes.
    """
    count = segment_count(ids, n)
    mu = segment_median(x, ids, n, value_order=value_order)
    z = torch.empty_like(x)
    torch.sub(x, select(mu, ids, n, out=z), out=z)
    below = z < 0
    side = torch.empty_like(z)
    side.copy_(below)
    n_below = segment_sum(side, ids, n)
    n_above = count.to(x.dtype) - n_below
    raw_minus = -segment_sum(torch.clamp(z, max=0.0, out=side), ids, n) / n_below.clamp(min=1)
    raw_plus = segment_sum(torch.clamp(z, min=0.0, out=side), ids, n) / n_above.clamp(min=1)
    usable = (count >= min_group) & ((raw_minus > eps) | (raw_plus > eps))
    fit = LaplaceFit(mu=mu, b_minus=raw_minus.clamp(min=eps), b_plus=raw_plus.clamp(min=eps), usable=usable, count=count)
    return fit, z, below


def laplace_cdf(x: Tensor, mu: Tensor, b_minus: Tensor, b_plus: Tensor, *, eta: float) -> Tensor:
    """Phi(x) of SPEC section 2, elementwise over already-gathered (or scalar) parameters.

    Exponents are clamped at 0 so the branch that ``where`` discards cannot
    overflow into inf/NaN.
    """
    z = x - mu
    lower = eta * torch.exp((z / b_minus).clamp(max=0.0))
    upper = 1.0 - (1.0 - eta) * torch.exp((-z / b_plus).clamp(max=0.0))
    return torch.where(z < 0, lower, upper)


def segment_laplace_cdf_(
    z: Tensor, below: Tensor, ids: Tensor, n: int, b_minus: Tensor, b_plus: Tensor, *, eta: float
) -> Tensor:
    """Phi from centred values ``z = x - mu[ids]`` with per-segment scales, in place in ``z``.

    Both sides share one exponential, ``E = exp(-|z| / b_side) <= 1`` (no overflow),
    then ``Phi = eta E + 0`` below the median and ``(eta - 1) E + 1`` at or above:
    the same floating-point results as :func:`laplace_cdf`'s two branches.  The
    side-dependent constants come from small tables indexed by ``2 * segment +
    below`` (``torch.where`` has no vectorised CPU kernel; a table lookup does).
    """
    side = below.to(torch.int32) if n == 1 else torch.add(below, ids, alpha=2)
    dt, dev = z.dtype, z.device
    buf = torch.empty_like(z)
    scales = torch.stack([b_plus.reshape(-1), b_minus.reshape(-1)], 1).reshape(-1)
    z.abs_().div_(torch.index_select(scales, 0, side, out=buf)).neg_().exp_()
    coef = torch.tensor([eta - 1.0, eta], dtype=dt, device=dev).repeat(n)
    offset = torch.tensor([1.0, 0.0], dtype=dt, device=dev).repeat(n)
    z.mul_(torch.index_select(coef, 0, side, out=buf))
    return z.add_(torch.index_select(offset, 0, side, out=buf))


def recentred_laplace_cdf_(
    x: Tensor, z: Tensor, ids: Tensor, n: int, mu: Tensor, b_minus: Tensor, b_plus: Tensor, *, eta: float
) -> Tensor:
    """Phi of ``x`` under per-segment parameters other than the fit's, written into ``z``.

    The fallback chains (fixed map, batch statistics) replace some segments'
    parameters after the fit; ``x`` is recentred into the fit's buffer and mapped.
    """
    torch.sub(x, select(mu, ids, n, out=z), out=z)
    return segment_laplace_cdf_(z, z < 0, ids, n, b_minus, b_plus, eta=eta)


@dataclass(frozen=True)
class GaussianFit:
    """Per-segment mean and floored population standard deviation."""

    mean: Tensor
    std: Tensor
    usable: Tensor
    count: Tensor


def fit_gaussian(x: Tensor, ids: Tensor, n: int, *, eps: float, min_group: int) -> GaussianFit:
    """Mean and ddof=0 standard deviation per segment for the ``gaussian`` variant.

    Usable mirrors the Laplace rule: enough values and a raw spread above ``eps``.
    """
    count = segment_count(ids, n)
    mean = segment_mean(x, ids, n)
    std = segment_std(x, ids, n)
    usable = (count >= min_group) & (std > eps)
    return GaussianFit(mean=mean, std=std.clamp(min=eps), usable=usable, count=count)


def normal_cdf(z: Tensor) -> Tensor:
    """Standard normal CDF via erf (exact in float64, no scipy on the training path)."""
    return 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
