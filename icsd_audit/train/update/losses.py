"""The per-token terms of the actor loss (verl's conventions), kept apart from the update loop.

Per token ``t`` of an actor mini-batch ``B`` the objective is
``pg_t + kl_coef * kl_t + lambda * sg(c_t) * l_KD_t`` (plus ``sdl_coef * sdl_t`` for the
Skill-SD baseline, :mod:`icsd_audit.train.update.hybrid`) and the mini-batch loss is its sum
over valid tokens divided by ``|B|`` (:mod:`icsd_audit.train.update.actor` says why and how
micro-batches accumulate).  The engine integrations (:mod:`icsd_audit.integrations`)
check their losses against these functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from icsd_audit.train.update.hybrid import sdl_loss

__all__ = ["ppo_dual_clip_loss", "low_var_kl", "kd_loss", "TokenLosses", "token_losses"]


def ppo_dual_clip_loss(logp: Tensor, old_logp: Tensor, advantage: Tensor, *, clip_ratio: float = 0.2,
                       dual_clip: float = 3.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """verl's clipped surrogate with dual clip, per token.

    Returns ``(loss, ratio, clipped, dual_clipped)``; ``clipped`` is verl's pg_clipfrac
    indicator (the clipped branch is the larger loss), ``dual_clipped`` marks tokens
    with A < 0 where the dual-clip cap binds.
    """
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    l1 = -advantage * ratio
    l2 = -advantage * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    clip1 = torch.maximum(l1, l2)
    l3 = -advantage * dual_clip
    clip2 = torch.minimum(l3, clip1)
    neg = advantage < 0
    loss = torch.where(neg, clip2, clip1)
    return loss, ratio, l2 > l1, (clip1 > l3) & neg


def low_var_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """verl's ``low_var_kl`` (Schulman's k3 estimator of KL(pi || ref)), per token."""
    kl = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(kl) - kl - 1.0).clamp(-10.0, 10.0)


def kd_loss(logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """l_KD = sg(teacher log-prob) - student log-prob, per token (Eq. sampled_aux)."""
    return teacher_logp.detach() - logp


@dataclass
class TokenLosses:
    total: Tensor  # per-token objective; sum / |B| is the mini-batch loss
    pg: Tensor
    kl: Tensor
    kd: Tensor
    aux: Tensor  # lambda * c * kd
    ratio: Tensor
    clipped: Tensor
    dual_clipped: Tensor
    sdl: Tensor  # Skill-SD's rho * K3 (0 unless sdl_coef > 0)


def token_losses(*, logp: Tensor, old_logp: Tensor, advantage: Tensor, ref_logp: Tensor | None,
                 teacher_logp: Tensor | None, c: Tensor | None, clip_ratio: float, dual_clip: float,
                 kl_coef: float, distill_coef: float, pg_coef: float = 1.0, sdl_coef: float = 0.0) -> TokenLosses:
    """Every per-token term of the actor loss; ``None`` inputs make their term 0.

    ``pg_coef`` weights the surrogate (0: no RL loss, stand-alone OPSD); ``sdl_coef`` > 0
    adds Skill-SD's ``sdl_coef * sdl_t`` (needs ``teacher_logp``)."""
    pg, ratio, clipped, dual = ppo_dual_clip_loss(logp, old_logp, advantage, clip_ratio=clip_ratio, dual_clip=dual_clip)
    zero = torch.zeros_like(logp)
    kl = low_var_kl(logp, ref_logp) if ref_logp is not None else zero
    kd = kd_loss(logp, teacher_logp) if teacher_logp is not None else zero
    aux = distill_coef * c.detach() * kd if (c is not None and teacher_logp is not None) else zero
    total = (pg if pg_coef == 1.0 else pg_coef * pg) + kl_coef * kl + aux
    sdl = zero
    if sdl_coef:
        if teacher_logp is None:
            raise ValueError("sdl_coef > 0 (Skill-SD) needs the teacher's log-probs")
        sdl = sdl_loss(logp, teacher_logp, old_logp)
        total = total + sdl_coef * sdl
    return TokenLosses(total=total, pg=pg, kl=kl, kd=kd, aux=aux, ratio=ratio, clipped=clipped, dual_clipped=dual,
                       sdl=sdl)
