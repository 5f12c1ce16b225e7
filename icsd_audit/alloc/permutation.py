"""Permutation controls in bulk: many ``permuted`` allocations from one calibration pass.

The gradient-compatibility audit compares ICSD with the same scores shuffled
among the C tokens of the batch, averaged over many shuffles.  Calling
``allocate(allocator="permuted")`` per shuffle would refit trust and calibration
every time; here they are fitted once, each shuffle is a scatter of the score
vector, and turn mass matching runs for all shuffles at once as one segment sum
over (shuffle, turn) ids.  Column j equals ``allocate(..., allocator="permuted",
seed=seeds[j]).c`` exactly.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from icsd_audit.alloc.segments import segment_sum
from icsd_audit.alloc.layout import ValidTokens, token_tensors
from icsd_audit.alloc.registry import get_trust
from icsd_audit.alloc.scores import calibrated, shuffle_pairs
from icsd_audit.alloc.settings import DEFAULTS, AllocatorSettings
from icsd_audit.tokens import Tokens

__all__ = ["permuted_coefficients"]


def permuted_coefficients(
    tokens: Tokens | None = None,
    /,
    settings: AllocatorSettings | None = None,
    *,
    seeds: Sequence[int],
    advantage: Tensor | None = None,
    ratio: Tensor | None = None,
    delta: Tensor | None = None,
    traj_id: Tensor | None = None,
    turn_id: Tensor | None = None,
    batch_id: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """Coefficients c of the ``permuted`` allocator for every seed, shape (n_rows, len(seeds)).

    Tokens come as a :class:`~icsd_audit.tokens.Tokens` or as keyword arrays, as for
    :func:`~icsd_audit.alloc.variants.allocate`; ``settings`` fixes the trust and calibration (its
    ``allocator`` and ``seed`` are not used: every column is a ``permuted`` allocation with its own seed).
    """
    s = settings or DEFAULTS
    advantage, ratio, delta, traj_id, turn_id, batch_id, valid = token_tensors(
        tokens, advantage=advantage, ratio=ratio, delta=delta, traj_id=traj_id, turn_id=turn_id, batch_id=batch_id,
        valid=valid)
    tok = ValidTokens.select(advantage, ratio, delta, traj_id, turn_id, batch_id, valid)
    a, r, d, lay = tok.advantage, tok.ratio, tok.delta, tok.layout
    p, device, dtype = len(seeds), a.device, a.dtype
    g, _ = get_trust(s.trust)(d, lay, eta=s.trust_eta, beta=s.trust_beta, eps=s.eps, min_group=s.min_group)
    fallback = (a < 0) & (d < 0)
    m0 = calibrated(a * r * d, lay, eta=s.influence_eta, eps=s.eps, min_group=s.min_group).m

    n = a.numel()
    m = m0.unsqueeze(0).repeat(p, 1)
    for j, seed in enumerate(seeds):  # a loop over shuffles (few), never over tokens
        src, dst = shuffle_pairs(fallback, lay, seed)
        m[j, dst] = m0[src]
    in_c = ~fallback
    zero = torch.zeros((), dtype=dtype, device=device)
    s_g = segment_sum(torch.where(in_c, g, zero), lay.turn, lay.n_turns)
    ids = (torch.arange(p, device=device).unsqueeze(1) * lay.n_turns + lay.turn.unsqueeze(0)).reshape(-1)
    gm = torch.where(in_c.unsqueeze(0), g.unsqueeze(0) * m, zero)
    s_gm = segment_sum(gm.reshape(-1), ids, p * lay.n_turns).reshape(p, lay.n_turns)
    matched = s_gm > s.eps
    alpha = s_g.unsqueeze(0) / torch.where(matched, s_gm, torch.ones_like(s_gm))
    turn = lay.turn.unsqueeze(0).expand(p, n)
    # (g * m) * alpha: the multiplication order of allocate(), so columns agree bit for bit
    c = torch.where(torch.gather(matched, 1, turn) & in_c.unsqueeze(0), gm * torch.gather(alpha, 1, turn), g)
    return tok.scatter(c.T.contiguous())
