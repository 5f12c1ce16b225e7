"""Log-probabilities of given response tokens under a causal LM, micro-batch by micro-batch.

One function serves every pass that scores the sampled tokens: the teacher (privileged
prompt, no grad), the reference (frozen initial policy, no grad), the ratio pre-pass
(no grad) and the actor's gradient pass. They differ only in the prompt ids and in
whether autograd records, so the same micro-batch scored twice with the same weights
gives the same numbers.

Layout of a micro-batch: ``[left pad | prompt | response | right pad]``. Prompts are
left-padded so that every response starts at the same column, which lets the model
return logits for the last ``R + 1`` columns only (``logits_to_keep``) instead of the
whole sequence: the vocabulary projection is then paid on response positions alone.
Position ids are counted from each row's first real token, as ``generate`` does.
Log-probs are taken from ``logits / temperature`` in float32 (verl divides by the
rollout temperature too), via ``gather - logsumexp``.

``with_score_norm=True`` also returns, from the same logits and without gradient, the
per-token *score norm* s_t = ||onehot(a_t) - softmax(z_t)||_2, the norm of the sampled
token's log-probability gradient with respect to the (temperature-scaled) logits (SPEC
1 and 5, used by the ``fisher`` allocator). It is computed as
sqrt((1 - p_a)^2 + sum_{j != a} p_j^2), with 1 - p_a = -expm1(logp) and the second sum from
a logsumexp over the logits with the sampled one masked, which equals SPEC's
sqrt(1 - 2 p_a + sum_j p_j^2) without its cancellation for confident tokens.

``with_entropy=True`` also returns, from the same logits, the entropy of the student's full
next-token distribution in nats (SPEC 11, the dumps' ``entropy`` column): H = -sum_j p_j log p_j
with p the softmax of the temperature-scaled logits, float32, no gradient, no extra forward.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["Packed", "pack", "response_logprobs", "split_rows", "score_rows", "autocast_for", "entropy_from_logits"]


@dataclass
class Packed:
    """One padded micro-batch."""

    input_ids: Tensor  # (B, P + R)
    attention_mask: Tensor  # (B, P + R)
    position_ids: Tensor  # (B, P + R)
    response_ids: Tensor  # (B, R)
    response_mask: Tensor  # (B, R) bool
    lengths: list[int]  # response length per row


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_id: int, device: torch.device | str) -> Packed:
    """Left-pad prompts and right-pad responses into one rectangle."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError("pack needs one response per prompt and at least one row")
    P = max(len(p) for p in prompts)
    R = max(max(len(r) for r in responses), 1)
    B = len(prompts)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    att = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p) : P] = torch.as_tensor(list(p), dtype=torch.long)
        ids[i, P : P + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        att[i, P - len(p) : P + len(r)] = 1
    pos = (att.cumsum(-1) - 1).clamp_min(0)
    lengths = [len(r) for r in responses]
    rmask = torch.arange(R)[None, :] < torch.as_tensor(lengths)[:, None]
    dev = torch.device(device)
    return Packed(ids.to(dev), att.to(dev), pos.to(dev), ids[:, P:].to(dev), rmask.to(dev), lengths)


def autocast_for(device: torch.device, precision: str) -> Any:
    """bf16 autocast context for 'bf16-mixed' (CUDA or CPU); a no-op otherwise.

    On a CPU, bf16 matmuls are fast only where the CPU has bf16 instructions (AVX512-BF16,
    AMX); elsewhere they are emulated, which is why 'auto' stays float32 on CPU
    (docs/benchmarks.md has the measured figures).
    """
    if precision == "bf16-mixed" and device.type in ("cuda", "cpu"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def score_norm_from_logits(logits: Tensor, ids: Tensor, logp: Tensor, lse: Tensor) -> Tensor:
    """||onehot(ids) - softmax(logits)||_2 per position (no grad), float32.

    ``logits`` (..., V) float32, ``ids`` (...) the sampled tokens, ``logp`` and ``lse`` the
    sampled log-probs and the logsumexp already computed from the same logits.
    """
    with torch.no_grad():
        masked = (2.0 * logits.detach()).scatter_(-1, ids.unsqueeze(-1), float("-inf"))
        rest = torch.exp(torch.logsumexp(masked, dim=-1) - 2.0 * lse.detach())  # sum_{j != a} p_j^2
        one_minus = -torch.expm1(logp.detach())  # 1 - p_a
        return torch.sqrt(one_minus * one_minus + rest)


def entropy_from_logits(logits: Tensor, lse: Tensor) -> Tensor:
    """Entropy in nats of softmax(``logits``) per position (no grad), float32.

    ``lse`` is the logsumexp already computed from the same logits: with log p_j = z_j - lse,
    H = -sum_j p_j log p_j, a term being 0 where p_j is 0 (a masked -inf logit, or an
    underflow).  Summing p_j log p_j rather than lse - sum_j p_j z_j avoids the cancellation of
    two large numbers when the logits are large and the entropy small.
    """
    with torch.no_grad():
        lp = logits.detach() - lse.detach().unsqueeze(-1)
        p = torch.exp(lp)
        return -torch.where(p > 0, p * lp, torch.zeros((), dtype=lp.dtype, device=lp.device)).sum(-1)


def response_logprobs(model: Any, packed: Packed, *, temperature: float = 1.0, with_score_norm: bool = False,
                      with_entropy: bool = False) -> Tensor | tuple[Tensor, ...]:
    """(B, R) float32 log-probs of the response tokens (0 at padding); differentiable.

    With ``with_score_norm``: ``(logp, score_norm)``, the second (B, R), detached, 0 at padding.
    With ``with_entropy``: ``(logp, score_norm or None, entropy)``, the entropy (B, R), detached,
    0 at padding.
    """
    R = packed.response_ids.shape[1]
    out = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        logits_to_keep=R + 1,
        use_cache=False,
    )
    logits = out.logits[:, -(R + 1) : -1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, packed.response_ids.unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    logp = (picked - lse).masked_fill(~packed.response_mask, 0.0)
    if not with_score_norm and not with_entropy:
        return logp
    sn = (score_norm_from_logits(logits, packed.response_ids, logp, lse).masked_fill(~packed.response_mask, 0.0)
          if with_score_norm else None)
    if not with_entropy:
        return logp, sn
    return logp, sn, entropy_from_logits(logits, lse).masked_fill(~packed.response_mask, 0.0)


def split_rows(rows: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive chunks of ``size`` rows (the last may be shorter)."""
    rows = list(rows)
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def score_rows(
    model: Any,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    micro_batches: Sequence[Sequence[int]],
    *,
    pad_id: int,
    device: torch.device,
    temperature: float,
    precision: str = "float32",
    score_norms: dict[int, Tensor] | None = None,
    entropies: dict[int, Tensor] | None = None,
) -> dict[int, Tensor]:
    """No-grad log-probs of the response tokens of the rows named in ``micro_batches``.

    Returns ``{row: float32 CPU tensor}`` (rows index ``prompts``/``responses``). When a
    ``score_norms`` (``entropies``) dict is given, it is filled with each row's score norms
    (entropies), from the same logits.
    """
    out: dict[int, Tensor] = {}
    with torch.no_grad(), autocast_for(device, precision):
        for mb in micro_batches:
            packed = pack([prompts[i] for i in mb], [responses[i] for i in mb], pad_id=pad_id, device=device)
            if score_norms is None and entropies is None:
                lp = response_logprobs(model, packed, temperature=temperature).cpu()
            else:
                got_all = response_logprobs(model, packed, temperature=temperature,
                                            with_score_norm=score_norms is not None, with_entropy=entropies is not None)
                lp_d, sn_d, ent_d = got_all if len(got_all) == 3 else (*got_all, None)
                lp = lp_d.cpu()
                for extra, got in ((score_norms, sn_d), (entropies, ent_d)):
                    if extra is not None:
                        got = got.cpu()
                        for j, i in enumerate(mb):
                            extra[i] = got[j, : packed.lengths[j]].clone()
            for j, i in enumerate(mb):
                out[i] = lp[j, : packed.lengths[j]].clone()
    return out
