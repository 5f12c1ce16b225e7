"""``allocate``: SPEC 3-5's coefficients for flat per-token tensors, through the registered trust and scores.

One implementation serves training (GPU, float32, one actor mini-batch) and the offline audit (CPU, float64, many
batches at once), so an audit recomputes exactly what training deployed. Everything is a pure function of flat
tensors: invalid tokens are dropped up front (:mod:`~icsd_audit.alloc.layout`), the trust map and the score come
from the registries (:mod:`~icsd_audit.alloc.trust`, :mod:`~icsd_audit.alloc.scores`), and turn mass matching
(SPEC 4.4) combines them here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

import icsd_audit.alloc.scores  # noqa: F401  (defining the scores registers the allocators)
import icsd_audit.alloc.trust  # noqa: F401  (and the trust maps)
from icsd_audit.alloc.layout import Layout, ValidTokens, token_tensors
from icsd_audit.alloc.registry import (AllocatorSpec, Combine, Score, allocator_names, get_allocator, get_trust,
                                       register_allocator, trust_names)
from icsd_audit.alloc.segments import segment_sum, select
from icsd_audit.alloc.settings import DEFAULTS, AllocatorSettings
from icsd_audit.tokens import Tokens

__all__ = ["Allocation", "AllocationDiagnostics", "AllocatorSpec", "AllocatorSettings", "allocate", "allocator_names",
           "register_allocator", "trust_names", "match_turn_mass"]


@dataclass(frozen=True)
class AllocationDiagnostics:
    """What the allocator did, for logs and the audit summary."""

    n_tokens: int
    n_batches: int
    n_groups: int
    n_turns: int
    fallback_share: float
    groups_batch_stats: int
    groups_fixed_map: int
    trust_fixed_map_batches: int
    degenerate_turns: int
    alpha_min: float
    alpha_max: float

    def to_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Allocation:
    """Per-token outputs, aligned with the input rows (zeros on invalid rows)."""

    g: Tensor
    u: Tensor
    m: Tensor
    c: Tensor
    fallback: Tensor
    diagnostics: AllocationDiagnostics


def match_turn_mass(g: Tensor, m: Tensor, fallback: Tensor, lay: Layout, *, combine: Combine, eps: float) -> tuple[Tensor, int, float, float]:
    """c = alpha_turn * w * m on C tokens (w = g or 1), g elsewhere and on unmatched turns.

    Masks enter as exact 0/1 multipliers (x * 1 = x, x * 0 = 0 and x + 0 = x in
    floating point), because ``where``/``masked_fill`` have no vectorised CPU kernel.
    """
    keep = torch.empty_like(g).copy_(~fallback)
    c = g * m if combine == "trust-weighted" else m.clone()
    c.mul_(keep)
    scratch = torch.mul(g, keep)
    s_g = segment_sum(scratch, lay.turn, lay.n_turns)
    s_wm = segment_sum(c, lay.turn, lay.n_turns)
    matched = s_wm > eps
    alpha = s_g / torch.where(matched, s_wm, torch.ones_like(s_wm))
    c.mul_(select(alpha, lay.turn, lay.n_turns, out=scratch))
    c.add_(torch.mul(g, keep.neg_().add_(1.0), out=scratch))  # g on the fallback set, where c is 0
    n_unmatched = int((~matched).sum())
    if n_unmatched:
        torch.where(matched[lay.turn], c, g, out=c)
    a = alpha[matched]
    a_min = float(a.min()) if a.numel() else math.nan
    a_max = float(a.max()) if a.numel() else math.nan
    return c, n_unmatched, a_min, a_max


def allocate(
    tokens: Tokens | None = None,
    /,
    settings: AllocatorSettings | None = None,
    *,
    advantage: Tensor | None = None,
    ratio: Tensor | None = None,
    delta: Tensor | None = None,
    traj_id: Tensor | None = None,
    turn_id: Tensor | None = None,
    batch_id: Tensor | None = None,
    valid: Tensor | None = None,
    score_norm: Tensor | None = None,
    allocator: str | None = None,
    trust: str | None = None,
    trust_beta: float | None = None,
    trust_eta: float | None = None,
    influence_eta: float | None = None,
    eps: float | None = None,
    min_group: int | None = None,
    seed: int | None = None,
) -> Allocation:
    """Compute g, u, m, c and the fallback flag for flat per-token tensors.

    Give either a :class:`~icsd_audit.tokens.Tokens` (numpy arrays are converted
    without copying; its optional ``score_norm`` column is used when present) or the
    arrays as keywords, as a trainer holding tensors does.
    Statistics never cross ``batch_id`` (default: one batch).  The float dtype of
    ``advantage`` sets the compute dtype (float64 for audits, float32 allowed in
    training); ``seed`` matters only for ``permuted``.  For ``sdar`` and ``opsd``
    the returned ``m`` is 1 (no score enters), and ``opsd`` forces uniform trust.
    ``score_norm`` (SPEC 1, optional column) is the per-token norm of the sampled
    token's log-probability gradient w.r.t. the logits; ``fisher`` requires it.

    ``settings`` (default: SPEC's) fixes the allocator; a setting also given as a keyword
    (``allocate(tokens, allocator="sdar")``) replaces that one setting.
    """
    s = (settings or DEFAULTS).replace(allocator=allocator, trust=trust, trust_beta=trust_beta, trust_eta=trust_eta,
                                       influence_eta=influence_eta, eps=eps, min_group=min_group, seed=seed)
    advantage, ratio, delta, traj_id, turn_id, batch_id, valid = token_tensors(
        tokens, advantage=advantage, ratio=ratio, delta=delta, traj_id=traj_id, turn_id=turn_id, batch_id=batch_id,
        valid=valid)
    spec = get_allocator(s.allocator)
    if score_norm is None and tokens is not None and "score_norm" in spec.requires and "score_norm" in tokens.columns:
        score_norm = torch.as_tensor(tokens.columns["score_norm"])  # an optional column of the reader's tokens
    if "score_norm" in spec.requires and score_norm is None:
        raise ValueError(f"allocator {s.allocator!r} needs the per-token 'score_norm' column (SPEC 5); "
                         "dumps written by `icsd train` carry it, others must add it")
    trust_fn = get_trust("uniform" if spec.combine == "uniform" else s.trust)
    if "score_norm" not in spec.requires:
        score_norm = None  # only the allocators that use it carry it through
    tok = ValidTokens.select(advantage, ratio, delta, traj_id, turn_id, batch_id, valid, score_norm)
    options = dict(spec=spec, trust_fn=trust_fn, trust_eta=s.trust_eta, trust_beta=s.trust_beta,
                   influence_eta=s.influence_eta, eps=s.eps, min_group=s.min_group, seed=s.seed)
    # Statistics never cross batches, so contiguous batches are allocated one at a time:
    # a single batch takes the selection-based medians instead of segment sorts, and
    # its temporaries stay small.  The permuted allocator keeps one random stream
    # over the whole call (the bulk permutation controls reproduce it).
    runs = tok.batch_runs() if spec.name != "permuted" else None
    if runs is None:
        parts = [_allocate_valid(tok.advantage, tok.ratio, tok.delta, tok.layout, score_norm=tok.score_norm, **options)]
    else:
        parts = []
        sn_parts = tok.score_norm.split(runs) if tok.score_norm is not None else [None] * len(runs)
        for a, r, d, b, tr, tu, sn in zip(*(x.split(runs) for x in (tok.advantage, tok.ratio, tok.delta, tok.batch_id,
                                                                      tok.traj_id, tok.turn_id)), sn_parts):
            parts.append(_allocate_valid(a, r, d, Layout.build(b, tr, tu), score_norm=sn, **options))
    outs = [p[0] for p in parts]
    g, u, m, c, fallback = (torch.cat([o[k] for o in outs]) if len(outs) > 1 else outs[0][k] for k in range(5))
    diag = _merge_diagnostics([p[1] for p in parts], n_fallback=int(fallback.sum()))
    return Allocation(g=tok.scatter(g), u=tok.scatter(u), m=tok.scatter(m), c=tok.scatter(c),
                      fallback=tok.scatter(fallback), diagnostics=diag)


def _allocate_valid(a: Tensor, r: Tensor, d: Tensor, lay: Layout, *, spec: AllocatorSpec, trust_fn: Callable[..., tuple[Tensor, int]],
                    trust_eta: float, trust_beta: float, influence_eta: float, eps: float, min_group: int,
                    seed: int, score_norm: Tensor | None = None,
                    ) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor, Tensor], AllocationDiagnostics]:
    """The allocation of valid rows with their layout: (g, u, m, c, fallback) and diagnostics."""
    g, trust_fixed = trust_fn(d, lay, eta=trust_eta, beta=trust_beta, eps=eps, min_group=min_group)
    u = torch.mul(a, r).mul_(d)
    fallback = (a < 0) & (d < 0)
    if spec.score is None:
        m = torch.ones_like(u)
        score = Score(m=m)
        c = g
        degenerate, a_min, a_max = 0, math.nan, math.nan
    else:
        score = spec.score(
            u=u, advantage=a, ratio=r, delta=d, fallback=fallback, lay=lay, score_norm=score_norm,
            eta=influence_eta, eps=eps, min_group=min_group, seed=seed,
        )
        m = score.m
        c, degenerate, a_min, a_max = match_turn_mass(g, m, fallback, lay, combine=spec.combine, eps=eps)
    n = int(a.numel())
    diag = AllocationDiagnostics(
        n_tokens=n,
        n_batches=lay.n_batches,
        n_groups=lay.n_groups,
        n_turns=lay.n_turns,
        fallback_share=float(fallback.sum()) / n if n else 0.0,
        groups_batch_stats=score.groups_batch_stats,
        groups_fixed_map=score.groups_fixed_map,
        trust_fixed_map_batches=trust_fixed,
        degenerate_turns=degenerate,
        alpha_min=a_min,
        alpha_max=a_max,
    )
    return (g, u, m, c, fallback), diag


def _merge_diagnostics(parts: list[AllocationDiagnostics], *, n_fallback: int) -> AllocationDiagnostics:
    """Diagnostics of batches allocated separately, as one call over all of them would report."""
    if len(parts) == 1:
        return parts[0]
    n = sum(p.n_tokens for p in parts)
    a_min = [p.alpha_min for p in parts if not math.isnan(p.alpha_min)]
    a_max = [p.alpha_max for p in parts if not math.isnan(p.alpha_max)]
    return AllocationDiagnostics(
        n_tokens=n,
        n_batches=sum(p.n_batches for p in parts),
        n_groups=sum(p.n_groups for p in parts),
        n_turns=sum(p.n_turns for p in parts),
        fallback_share=n_fallback / n if n else 0.0,
        groups_batch_stats=sum(p.groups_batch_stats for p in parts),
        groups_fixed_map=sum(p.groups_fixed_map for p in parts),
        trust_fixed_map_batches=sum(p.trust_fixed_map_batches for p in parts),
        degenerate_turns=sum(p.degenerate_turns for p in parts),
        alpha_min=min(a_min) if a_min else math.nan,
        alpha_max=max(a_max) if a_max else math.nan,
    )
