"""Token allocators of SPEC sections 3-5: SDAR trust, ICSD and the ablation variants.

One implementation serves training (GPU, float32, one actor mini-batch) and the
offline audit (CPU, float64, many batches at once), so an audit recomputes exactly
what training deployed.  Everything is a pure function of flat tensors: invalid
tokens are dropped up front, statistics are segment reductions keyed by
(batch), (batch, turn) and (batch, trajectory, turn), and results are scattered
back with zeros on invalid rows.

An allocator is a score ``m`` (how strongly the RL objective supports the teacher's
push on a token) plus a combination rule that turns trust ``g`` and ``m`` into the
coefficient ``c``.  Both live in registries that reject duplicates and list the
valid names on a bad one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor

from icsd_audit.alloc.calibration import (fit_gaussian, fit_laplace, fit_laplace_centered, normal_cdf, recentred_laplace_cdf_,
                          segment_laplace_cdf_)
from icsd_audit.alloc.segments import combine_ranks, dense_rank, order_key, segment_sum, select
from icsd_audit.tokens import Tokens

__all__ = [
    "Allocation",
    "AllocationDiagnostics",
    "AllocatorSpec",
    "Layout",
    "allocate",
    "check_settings",
    "allocator_names",
    "get_trust",
    "ValidTokens",
    "get_allocator",
    "register_allocator",
    "trust_names",
    "TRUST_ETA",
    "INFLUENCE_ETA",
    "EPS",
    "MIN_GROUP",
    "SIGMOID_BETA",
]

TRUST_ETA = 0.4
INFLUENCE_ETA = 0.5
EPS = 1e-4
MIN_GROUP = 8
SIGMOID_BETA = 5.0

Combine = Literal["trust-weighted", "influence-only", "trust", "uniform"]


@dataclass(frozen=True)
class Layout:
    """Dense segment ids of the valid tokens: batches, calibration groups, turns."""

    batch: Tensor
    n_batches: int
    group: Tensor
    n_groups: int
    group_batch: Tensor
    turn: Tensor
    n_turns: int

    @staticmethod
    def build(batch_id: Tensor, traj_id: Tensor, turn_id: Tensor) -> "Layout":
        batch, n_batches = dense_rank(batch_id)
        turn_rank, n_turn_ids = dense_rank(turn_id)
        group, n_groups = combine_ranks(batch, turn_rank, n_turn_ids, n_ids=n_batches)
        runs = _sorted_runs(batch_id, traj_id, turn_id)
        if runs is not None:
            # Dumps and trainer batches arrive sorted by (batch, traj, turn): each
            # turn is one run, so its id is a running count of key changes.
            turn = torch.cumsum(runs, 0).sub_(1)
            n_turns = int(turn[-1]) + 1 if turn.numel() else 0
        else:
            traj, _ = combine_ranks(batch, *dense_rank(traj_id), n_ids=n_batches)
            turn, n_turns = combine_ranks(traj, turn_rank, n_turn_ids)
        group_batch = torch.zeros(n_groups, dtype=torch.long, device=batch.device)
        if n_batches > 1:
            group_batch[group] = batch
        return Layout(batch, n_batches, group, n_groups, group_batch, turn, n_turns)


def _sorted_runs(*keys: Tensor) -> Tensor | None:
    """Run starts (bool per row) if rows are in non-decreasing lexicographic order of ``keys``, else None.

    When the id ranges fit, the keys are packed into one int64 so the order and the
    run boundaries come from a single difference; otherwise keys are compared one
    at a time.
    """
    n = keys[0].numel()
    if n < 2:
        return torch.ones(n, dtype=torch.bool, device=keys[0].device)
    bounds = [tuple(int(v) for v in torch.aminmax(k)) for k in keys]
    widths = [hi - lo + 1 for lo, hi in bounds]
    if math.prod(widths) < 2**62:
        packed = keys[0] - bounds[0][0]
        for key, (lo, _), w in zip(keys[1:], bounds[1:], widths[1:]):
            packed.mul_(w).add_(key)
            if lo:
                packed.sub_(lo)
        d = packed[1:] - packed[:-1]
        if bool((d < 0).any()):
            return None
        new = torch.empty(n, dtype=torch.bool, device=d.device)
        new[0] = True
        torch.ne(d, 0, out=new[1:])
        return new
    undecided = torch.ones(n - 1, dtype=torch.bool, device=keys[0].device)
    for key in keys:
        d = key[1:] - key[:-1]
        if bool((undecided & (d < 0)).any()):
            return None
        undecided &= d == 0
    new = torch.ones(n, dtype=torch.bool, device=keys[0].device)
    new[1:] = ~undecided
    return new


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


@dataclass(frozen=True)
class _Score:
    m: Tensor
    groups_batch_stats: int = 0
    groups_fixed_map: int = 0


ScoreFn = Callable[..., _Score]


@dataclass(frozen=True)
class AllocatorSpec:
    """A registry entry: the score that enters turn mass matching and how it combines."""

    name: str
    combine: Combine
    score: ScoreFn | None
    description: str
    #: Optional per-token columns this allocator cannot do without (e.g. ``score_norm``).
    requires: tuple[str, ...] = ()


_ALLOCATORS: dict[str, AllocatorSpec] = {}


def register_allocator(spec: AllocatorSpec) -> AllocatorSpec:
    """Add an allocator; a second entry under the same name is a programming error."""
    if spec.name in _ALLOCATORS:
        raise ValueError(f"allocator {spec.name!r} is already registered")
    _ALLOCATORS[spec.name] = spec
    return spec


def get_allocator(name: str) -> AllocatorSpec:
    try:
        return _ALLOCATORS[name]
    except KeyError:
        raise ValueError(f"unknown allocator {name!r}; valid: {', '.join(allocator_names())}") from None


def allocator_names() -> list[str]:
    return sorted(_ALLOCATORS)


# --- trust (SPEC 3) ------------------------------------------------------------


def _trust_laplace(delta: Tensor, lay: Layout, *, eta: float, beta: float, eps: float, min_group: int) -> tuple[Tensor, int]:
    fit, z, below = fit_laplace_centered(delta, lay.batch, lay.n_batches, eps=eps, min_group=min_group)
    n_fixed = int((~fit.usable).sum())
    if not n_fixed:
        return segment_laplace_cdf_(z, below, lay.batch, lay.n_batches, fit.b_minus, fit.b_plus, eta=eta), 0
    # unusable batches take the fixed map (mu 0, scales 1)
    one = torch.ones_like(fit.mu)
    mu, bm, bp = (torch.where(fit.usable, v, d) for v, d in ((fit.mu, 0 * one), (fit.b_minus, one), (fit.b_plus, one)))
    return recentred_laplace_cdf_(delta, z, lay.batch, lay.n_batches, mu, bm, bp, eta=eta), n_fixed


def _trust_sigmoid(delta: Tensor, lay: Layout, *, eta: float, beta: float, eps: float, min_group: int) -> tuple[Tensor, int]:
    return torch.sigmoid(beta * delta), 0


def _trust_uniform(delta: Tensor, lay: Layout, *, eta: float, beta: float, eps: float, min_group: int) -> tuple[Tensor, int]:
    return torch.ones_like(delta), 0


_TRUST: dict[str, Callable[..., tuple[Tensor, int]]] = {
    "laplace": _trust_laplace,
    "sigmoid": _trust_sigmoid,
    "uniform": _trust_uniform,
}


def trust_names() -> list[str]:
    return sorted(_TRUST)


# --- scores (SPEC 4-5) -----------------------------------------------------------


def calibrated(x: Tensor, lay: Layout, *, eta: float, eps: float, min_group: int) -> _Score:
    """Phi_G(x) with the group -> batch -> fixed-map fallback chain of SPEC 4.2.

    The batch fit is only needed when some group is unusable; otherwise the centred
    values of the group fit are mapped in place.
    """
    order = torch.argsort(order_key(x), stable=True)
    grp, z, below = fit_laplace_centered(x, lay.group, lay.n_groups, eps=eps, min_group=min_group, value_order=order)
    if bool(grp.usable.all()):
        m = segment_laplace_cdf_(z, below, lay.group, lay.n_groups, grp.b_minus, grp.b_plus, eta=eta)
        return _Score(m=m)
    bat = fit_laplace(x, lay.batch, lay.n_batches, eps=eps, min_group=min_group, value_order=order)
    # Choose each group's parameters on the (tiny) per-group arrays, then map once.
    gb = lay.group_batch
    batch_ok = bat.usable[gb]
    one = torch.ones_like(grp.mu)
    mu = torch.where(grp.usable, grp.mu, torch.where(batch_ok, bat.mu[gb], 0 * one))
    bm = torch.where(grp.usable, grp.b_minus, torch.where(batch_ok, bat.b_minus[gb], one))
    bp = torch.where(grp.usable, grp.b_plus, torch.where(batch_ok, bat.b_plus[gb], one))
    m = recentred_laplace_cdf_(x, z, lay.group, lay.n_groups, mu, bm, bp, eta=eta)
    return _Score(
        m=m,
        groups_batch_stats=int((~grp.usable & batch_ok).sum()),
        groups_fixed_map=int((~grp.usable & ~batch_ok).sum()),
    )


def _score_icsd(*, u: Tensor, advantage: Tensor, ratio: Tensor, lay: Layout, eta: float, eps: float, min_group: int, **_: object) -> _Score:
    return calibrated(u, lay, eta=eta, eps=eps, min_group=min_group)


def _score_fisher(*, advantage: Tensor, ratio: Tensor, score_norm: Tensor, lay: Layout, eta: float, eps: float,
                  min_group: int, **_: object) -> _Score:
    # |A * rho| alone is constant over a turn wherever rho is, and turn mass matching
    # cancels per-turn constants; the per-token score norm is what varies inside a turn.
    return calibrated((advantage * ratio).abs() * score_norm, lay, eta=eta, eps=eps, min_group=min_group)


def _score_sign(*, u: Tensor, **_: object) -> _Score:
    return _Score(m=(torch.sign(u) + 1.0) / 2.0)


def _score_gaussian(*, u: Tensor, lay: Layout, eps: float, min_group: int, **_: object) -> _Score:
    grp = fit_gaussian(u, lay.group, lay.n_groups, eps=eps, min_group=min_group)
    bat = fit_gaussian(u, lay.batch, lay.n_batches, eps=eps, min_group=min_group)
    gb = lay.group_batch
    batch_ok = bat.usable[gb]
    one = torch.ones_like(grp.mean)
    mean = torch.where(grp.usable, grp.mean, torch.where(batch_ok, bat.mean[gb], 0 * one))
    std = torch.where(grp.usable, grp.std, torch.where(batch_ok, bat.std[gb], one))
    return _Score(
        m=normal_cdf((u - mean[lay.group]) / std[lay.group]),
        groups_batch_stats=int((~grp.usable & batch_ok).sum()),
        groups_fixed_map=int((~grp.usable & ~batch_ok).sum()),
    )


def _score_permuted(*, u: Tensor, fallback: Tensor, lay: Layout, eta: float, eps: float, min_group: int, seed: int, **_: object) -> _Score:
    """ICSD scores shuffled uniformly among the C tokens of each batch.

    Random keys come from a CPU generator so a seed means the same shuffle on any
    device.  Sorting C tokens by (batch, key) and by (batch, position) pairs the
    i-th slot of each batch in both orders: a uniform within-batch permutation.
    """
    base = calibrated(u, lay, eta=eta, eps=eps, min_group=min_group)
    src, dst = shuffle_pairs(fallback, lay, seed)
    m = base.m.clone()
    m[dst] = base.m[src]
    return _Score(m=m, groups_batch_stats=base.groups_batch_stats, groups_fixed_map=base.groups_fixed_map)


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


for _spec in (
    AllocatorSpec("opsd", "uniform", None, "plain OPSD: c = 1 on every valid token"),
    AllocatorSpec("sdar", "trust", None, "SDAR: c = g, the base trust"),
    AllocatorSpec("icsd", "trust-weighted", _score_icsd, "ICSD: m = Phi_G(A*rho*delta), turn mass matched"),
    AllocatorSpec("fisher", "trust-weighted", _score_fisher,
                  "m = Phi_G(|A*rho| * score_norm): unsigned per-token policy-gradient magnitude", ("score_norm",)),
    AllocatorSpec("sign", "trust-weighted", _score_sign, "m = 1 / 0.5 / 0 for u > 0 / = 0 / < 0"),
    AllocatorSpec("influence-only", "influence-only", _score_icsd, "ICSD with g replaced by 1 inside C"),
    AllocatorSpec("gaussian", "trust-weighted", _score_gaussian, "m = normal CDF of the group z-score of u"),
    AllocatorSpec("permuted", "trust-weighted", _score_permuted, "ICSD scores shuffled among C tokens of the batch (seeded)"),
):
    register_allocator(_spec)


# --- turn mass matching (SPEC 4.4) ----------------------------------------------------


def _match_turn_mass(g: Tensor, m: Tensor, fallback: Tensor, lay: Layout, *, combine: Combine, eps: float) -> tuple[Tensor, int, float, float]:
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


# --- valid-token selection, shared with the bulk permutation controls -------------------


def get_trust(name: str) -> Callable[..., tuple[Tensor, int]]:
    try:
        return _TRUST[name]
    except KeyError:
        raise ValueError(f"unknown trust {name!r}; valid: {', '.join(trust_names())}") from None


@dataclass(frozen=True)
class ValidTokens:
    """The valid rows in the compute dtype with their ids, and the way back.

    Invalid rows are dropped up front (they enter no fit) and come back as zeros; when
    every row is valid, selection and scatter are free.  The segment layout is built
    on first use, so callers that split the rows by batch first never pay for it.
    """

    advantage: Tensor
    ratio: Tensor
    delta: Tensor
    batch_id: Tensor
    traj_id: Tensor
    turn_id: Tensor
    index: Tensor
    n_rows: int
    all_valid: bool
    score_norm: Tensor | None = None

    @property
    def n_valid(self) -> int:
        return self.n_rows if self.all_valid else int(self.index.numel())

    @functools.cached_property
    def layout(self) -> Layout:
        return Layout.build(self.batch_id, self.traj_id, self.turn_id)

    @staticmethod
    def select(advantage: Tensor, ratio: Tensor, delta: Tensor, traj_id: Tensor, turn_id: Tensor,
               batch_id: Tensor | None, valid: Tensor | None, score_norm: Tensor | None = None) -> "ValidTokens":
        dtype = advantage.dtype if advantage.is_floating_point() else torch.float64
        n_rows, device = advantage.shape[0], advantage.device
        valid = torch.ones(n_rows, dtype=torch.bool, device=device) if valid is None else valid.to(torch.bool)
        if batch_id is None:
            batch_id = torch.zeros((), dtype=torch.long, device=device).expand(n_rows)
        all_valid = bool(valid.all())
        # with every row valid, selection and scatter are identities: no index is built
        idx = torch.empty(0, dtype=torch.long, device=device) if all_valid else torch.nonzero(valid).squeeze(1)

        def take(x: Tensor) -> Tensor:
            return x if all_valid else x[idx]

        return ValidTokens(
            advantage=take(advantage).to(dtype), ratio=take(ratio).to(dtype), delta=take(delta).to(dtype),
            batch_id=take(batch_id).long(), traj_id=take(traj_id).long(), turn_id=take(turn_id).long(),
            index=idx, n_rows=n_rows, all_valid=all_valid,
            score_norm=None if score_norm is None else take(score_norm).to(dtype),
        )

    def batch_runs(self) -> list[int] | None:
        """Row counts of the batches when each batch is one contiguous run of rows
        (dumps and trainer batches are sorted so); None for one batch or interleaved ones."""
        if self.batch_id.numel() == 0 or self.batch_id.stride(0) == 0:
            return None
        lo, hi = torch.aminmax(self.batch_id)
        if bool(lo == hi):
            return None
        values, counts = torch.unique_consecutive(self.batch_id, return_counts=True)
        if torch.unique(values).numel() != values.numel():
            return None
        return counts.tolist()

    def scatter(self, x: Tensor) -> Tensor:
        """Rows of ``x`` (valid tokens, optionally with trailing dims) back to all rows, zeros elsewhere."""
        if self.all_valid:
            return x
        out = torch.zeros((self.n_rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        out[self.index] = x
        return out


# --- the entry point ------------------------------------------------------------------


def allocate(
    tokens: Tokens | None = None,
    /,
    *,
    advantage: Tensor | None = None,
    ratio: Tensor | None = None,
    delta: Tensor | None = None,
    traj_id: Tensor | None = None,
    turn_id: Tensor | None = None,
    batch_id: Tensor | None = None,
    valid: Tensor | None = None,
    allocator: str = "icsd",
    trust: str = "laplace",
    trust_eta: float = TRUST_ETA,
    trust_beta: float = SIGMOID_BETA,
    influence_eta: float = INFLUENCE_ETA,
    eps: float = EPS,
    min_group: int = MIN_GROUP,
    seed: int = 0,
    score_norm: Tensor | None = None,
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
    """
    advantage, ratio, delta, traj_id, turn_id, batch_id, valid = token_tensors(
        tokens, advantage=advantage, ratio=ratio, delta=delta, traj_id=traj_id, turn_id=turn_id, batch_id=batch_id,
        valid=valid)
    spec = get_allocator(allocator)
    if score_norm is None and tokens is not None and "score_norm" in spec.requires and "score_norm" in tokens.columns:
        score_norm = torch.as_tensor(tokens.columns["score_norm"])  # an optional column of the reader's tokens
    if "score_norm" in spec.requires and score_norm is None:
        raise ValueError(f"allocator {allocator!r} needs the per-token 'score_norm' column (SPEC 5); "
                         "dumps written by `icsd train` carry it, others must add it")
    trust_fn = get_trust("uniform" if spec.combine == "uniform" else trust)
    check_settings(trust_beta=trust_beta, trust_eta=trust_eta, influence_eta=influence_eta, eps=eps,
                   min_group=min_group)
    if "score_norm" not in spec.requires:
        score_norm = None  # only the allocators that use it carry it through
    tok = ValidTokens.select(advantage, ratio, delta, traj_id, turn_id, batch_id, valid, score_norm)
    options = dict(spec=spec, trust_fn=trust_fn, trust_eta=trust_eta, trust_beta=trust_beta,
                   influence_eta=influence_eta, eps=eps, min_group=min_group, seed=seed)
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


def check_settings(*, trust_beta: float = SIGMOID_BETA, trust_eta: float = TRUST_ETA,
                   influence_eta: float = INFLUENCE_ETA, eps: float = EPS, min_group: int = MIN_GROUP) -> None:
    """Refuse settings no allocation can use, as training does (a NaN slope made every g NaN).

    ``trust_beta`` and ``eps`` finite and > 0, the Laplace maps' ``eta`` in (0, 1),
    ``min_group`` an integer >= 1.
    """
    for name, v in (("trust_beta", trust_beta), ("eps", eps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    for name, v in (("trust_eta", trust_eta), ("influence_eta", influence_eta)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            raise ValueError(f"{name} must lie in (0, 1), got {v!r}")
    if isinstance(min_group, bool) or int(min_group) != min_group or min_group < 1:
        raise ValueError(f"min_group must be an integer >= 1, got {min_group!r}")


def token_tensors(tokens: Tokens | None, **arrays: Tensor | None) -> tuple[Tensor | None, ...]:
    """The seven input arrays, from a Tokens or from keywords (never both)."""
    names = ("advantage", "ratio", "delta", "traj_id", "turn_id", "batch_id", "valid")
    if tokens is not None:
        given = [k for k in names if arrays[k] is not None]
        if given:
            raise TypeError(f"give tokens or arrays, not both (also got {', '.join(given)})")
        t = tokens.torch()
        return tuple(getattr(t, k) for k in names)
    missing = [k for k in names[:5] if arrays[k] is None]
    if missing:
        raise TypeError(f"missing token arrays: {', '.join(missing)} (or pass a Tokens)")
    return tuple(arrays[k] for k in names)


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
        score = _Score(m=m)
        c = g
        degenerate, a_min, a_max = 0, math.nan, math.nan
    else:
        score = spec.score(
            u=u, advantage=a, ratio=r, delta=d, fallback=fallback, lay=lay, score_norm=score_norm,
            eta=influence_eta, eps=eps, min_group=min_group, seed=seed,
        )
        m = score.m
        c, degenerate, a_min, a_max = _match_turn_mass(g, m, fallback, lay, combine=spec.combine, eps=eps)
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
