"""Base trust g (SPEC 3): each map registered under its name where it is defined."""

from __future__ import annotations

import torch
from torch import Tensor

from icsd_audit.alloc.calibration import fit_laplace_centered, recentred_laplace_cdf_, segment_laplace_cdf_
from icsd_audit.alloc.layout import Layout
from icsd_audit.alloc.registry import register_trust

__all__ = ["trust_laplace", "trust_sigmoid", "trust_uniform"]


@register_trust("laplace")
def trust_laplace(delta: Tensor, lay: Layout, *, eta: float, beta: float, eps: float, min_group: int) -> tuple[Tensor, int]:
    """SPEC 3 default: the asymmetric Laplace map fitted on each batch's delta; the fixed map where a fit is unusable."""
    fit, z, below = fit_laplace_centered(delta, lay.batch, lay.n_batches, eps=eps, min_group=min_group)
    n_fixed = int((~fit.usable).sum())
    if not n_fixed:
        return segment_laplace_cdf_(z, below, lay.batch, lay.n_batches, fit.b_minus, fit.b_plus, eta=eta), 0
    # unusable batches take the fixed map (mu 0, scales 1)
    one = torch.ones_like(fit.mu)
    mu, bm, bp = (torch.where(fit.usable, v, d) for v, d in ((fit.mu, 0 * one), (fit.b_minus, one), (fit.b_plus, one)))
    return recentred_laplace_cdf_(delta, z, lay.batch, lay.n_batches, mu, bm, bp, eta=eta), n_fixed


@register_trust("sigmoid")
def trust_sigmoid(delta: Tensor, lay: Layout, *, eta: float, beta: float, eps: float, min_group: int) -> tuple[Tensor, int]:
    """SDAR's public code: sigmoid(beta * delta)."""
    return torch.sigmoid(beta * delta), 0


@register_trust("uniform")
def trust_uniform(delta: Tensor, lay: Layout, *, eta: float, beta: float, eps: float, min_group: int) -> tuple[Tensor, int]:
    """Plain OPSD: g = 1."""
    return torch.ones_like(delta), 0
