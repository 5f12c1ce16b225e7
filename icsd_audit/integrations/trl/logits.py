"""Per-token quantities :func:`~icsd_audit.integrations.trl.recorder.record` derives from the logits TRL's loss holds.

No forward pass and no gradient: the sampled tokens' log-probs (bit for bit TRL's
``selective_log_softmax``), the student's next-token entropies (SPEC 11), the teacher's log-probs
of the sampled tokens (NaN outside the student's top-k support in ``topk_logits`` mode) and that
support's membership.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["sampled_token_logps", "token_logps", "student_logps_and_entropy", "student_entropy",
           "teacher_token_logps", "in_topk"]


def sampled_token_logps(logits: Tensor, ids: Tensor) -> Tensor:
    """``log softmax(logits)[ids]`` per token with TRL's own ``selective_log_softmax`` (no gradient)."""
    from trl.trainer.utils import selective_log_softmax

    with torch.no_grad():
        return selective_log_softmax(logits.detach(), ids)


def token_logps(logits: Tensor, ids: Tensor, lse: Tensor | None = None) -> Tensor:
    """``[B, T]`` float32 ``log softmax(logits)[ids]`` with one batched logsumexp (no gradient).

    TRL's ``selective_log_softmax`` takes one logsumexp per row in a Python loop; this is the
    same sum per position in one call, and ``lse`` (from :func:`torch.logsumexp` of the same
    float32 logits) lets the entropy share it.
    """
    with torch.no_grad():
        z = logits.detach().float()
        if lse is None:
            lse = torch.logsumexp(z, dim=-1)
        return z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse


def student_logps_and_entropy(logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """The sampled tokens' log-probs and the next-token entropies in nats (SPEC 11) from one logsumexp.

    ``log p = z - logsumexp(z)`` per position, the log-probs bit for bit as TRL's
    ``selective_log_softmax`` gives them (so they agree with the distillation term TRL computed
    from its own); H = -sum_j p_j log p_j from those log-probs (no cancellation of two large
    numbers), a -inf log-prob (a masked logit) clamped to the smallest float so that its term is 0.
    """
    with torch.no_grad():
        z = logits.detach().float()
        lp = z - torch.logsumexp(z, dim=-1, keepdim=True)
        logp = lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        p = lp.exp()
        p.mul_(lp.clamp_(min=torch.finfo(lp.dtype).min))
        return logp, -p.sum(-1)


def student_entropy(logits: Tensor) -> Tensor:
    """``[B, T]`` float32 entropy in nats of ``softmax(logits)`` per token (SPEC 11; no gradient, no forward)."""
    from icsd_audit.train.update.logprobs import entropy_from_logits

    with torch.no_grad():
        z = logits.detach().float()
        return entropy_from_logits(z, torch.logsumexp(z, dim=-1))


def teacher_token_logps(trainer: Any, student_logits: Tensor, teacher_logits: Tensor, ids: Tensor) -> Tensor:
    """The teacher's log-prob of each sampled token; NaN (null in the dump) outside the student's top-k support."""
    t = token_logps(teacher_logits, ids)
    a = trainer.args
    if getattr(a, "distillation_mode", None) == "topk_logits" and a.distillation_topk is not None:
        inside = in_topk(student_logits, ids, a.distillation_topk)
        t = torch.where(inside, t, torch.full_like(t, float("nan")))
    return t


def in_topk(logits: Tensor, ids: Tensor, k: int) -> Tensor:
    """``[B, T]`` bool: is ``ids`` among ``torch.topk(logits, k)``'s indices (TRL's top-k support)?

    By rank, without sorting: a token with fewer than ``k`` logits above it and at most ``k``
    at or above it is inside, one with ``k`` or more above it outside; only a tie across the
    k-th place is settled by ``torch.topk`` itself, on those positions alone.
    """
    with torch.no_grad():
        z = logits.detach()
        mine = z.gather(-1, ids.unsqueeze(-1))
        above, at_or_above = (z > mine).sum(-1), (z >= mine).sum(-1)
        inside = at_or_above <= k
        tie = (above < k) & ~inside
        if bool(tie.any()):
            top = torch.topk(z[tie], k=k, dim=-1).indices
            inside[tie] = (top == ids[tie].unsqueeze(-1)).any(-1)
    return inside
