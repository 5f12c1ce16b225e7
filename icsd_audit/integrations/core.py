"""Engine-free ICSD over padded ``[B, T]`` batches: the piece every engine adapter shares.

Engines (verl, verl-agent/SDAR forks, TRL) hold an actor mini-batch as padded rows
with a response mask.  This module turns such a batch into the flat token arrays
:func:`icsd_audit.alloc.allocate` takes, in the canonical (trajectory, turn, position)
order the dumps use, and scatters the coefficients back onto the padded grid.

* **Turn ids** come either from per-row turn indices (verl-agent/SDAR: one row per
  turn, ``turn_step``) or from the mask itself (TRL multi-turn: each run of 1s in a
  row's environment/tool mask is one action turn, numbered from ``turn_offset``).
* **Position** of a token is its index among its row's masked positions (the
  ``pos`` :class:`~icsd_audit.dumps.writer.DumpWriter` derives), so the canonical
  order here is exactly the order a dump is written in and read back.
* **Duplicate rows.**  verl-agent's ``adjust_batch`` pads a batch to a divisible
  size by copying random rows.  A copy would otherwise add its tokens a second time
  to its calibration group's median and scales and to its turn's mass.  Choice:
  rows with the same (trajectory, first turn id) key are one turn; the first
  occurrence enters the allocation, every later copy is left out of it (and out of
  the dump) and receives the original's coefficients position by position.  Copies
  therefore still enter the *loss* (as they enter verl's policy loss), each with the
  weight its original gets, exactly what a per-token gate (SDAR) would give them.
  Two rows that share the key but differ in their response masks are not copies:
  that is an input error.  Copies are found within the batch given (one actor
  mini-batch): a copy whose original went to another mini-batch is its turn's only
  instance in its own, and counts once there.
* The allocation runs in float64 on float32-rounded inputs (what a dump stores), so
  ``icsd audit coeffs`` on the dump recomputes the deployed ``c`` exactly.

Imports only torch and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import hashlib
import math
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

from icsd_audit.alloc.settings import DEFAULTS, SETTING_NAMES, AllocatorSettings
from icsd_audit.alloc.variants import AllocationDiagnostics, allocate
from icsd_audit.integrations.checks import TrajNames, check_mask, check_values

__all__ = [
    "C_KEY",
    "TEACHER_KEY",
    "stable_traj_id",
    "AllocationSettings",
    "PaddedAllocation",
    "tcm",
    "tcm_sums",
    "mechanism_sums",
    "mechanism_metrics",
    "turn_ids_from_mask",
    "duplicate_rows",
    "allocate_padded",
    "distillation_token_loss",
    "distillation_loss",
    "dump_rows",
    "write_dump",
    "mini_batch_ids",
    "dump_writer",
]

#: batch key of the allocation ``c`` in every engine's batch (verl, verl-agent forks)
C_KEY = "icsd_c"
#: batch key of the privileged teacher's log-probs in verl (not ``teacher_logprobs``, which verl rewrites)
TEACHER_KEY = "icsd_teacher_log_probs"


def stable_traj_id(uid: Any) -> int:
    """A 63-bit integer id for a trajectory uid (same uid, same id on every process and run).

    BLAKE2b, not Python's salted ``hash``: trajectory ids go into dumps read by other processes.
    """
    return int.from_bytes(hashlib.blake2b(str(uid).encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class PaddedAllocation:
    """Allocation outputs on the padded grid (zeros where the mask is 0), float64."""

    g: Tensor
    u: Tensor
    m: Tensor
    c: Tensor
    fallback: Tensor
    turn_id: Tensor  # [B, T] int64, -1 off the mask
    pos: Tensor  # [B, T] int64, index among the row's masked positions, -1 off the mask
    duplicate_of: Tensor  # [B] int64: index of the row a copy repeats, -1 for originals
    diagnostics: AllocationDiagnostics


def turn_ids_from_mask(mask: Tensor, turn_offset: Tensor | None = None) -> Tensor:
    """Turn index of every masked position: the runs of 1s in a row are turns 0, 1, 2, ...

    ``turn_offset`` (``[B]``) is added per row (a row that continues a trajectory).
    Positions off the mask get -1.
    """
    m = mask.bool()
    start = m.clone()
    start[:, 1:] &= ~m[:, :-1]
    turn = torch.cumsum(start.long(), dim=1) - 1
    if turn_offset is not None:
        turn = turn + torch.as_tensor(turn_offset, device=turn.device).long().view(-1, 1)
    return torch.where(m, turn, torch.full_like(turn, -1))


def _row_turns(turn_id: Tensor, mask: Tensor) -> Tensor:
    """A ``[B, T]`` int64 grid of turn ids from per-row ``[B]`` or per-token ``[B, T]`` input."""
    t = torch.as_tensor(turn_id, device=mask.device).long()
    if t.dim() == 1:
        if t.shape[0] != mask.shape[0]:
            raise ValueError(f"turn_id has {t.shape[0]} rows, the mask {mask.shape[0]}")
        t = t.view(-1, 1).expand(mask.shape)
    elif t.shape != mask.shape:
        raise ValueError(f"turn_id of shape {tuple(t.shape)} fits neither the mask {tuple(mask.shape)} nor its rows")
    return torch.where(mask, t, torch.full_like(t, -1))


def duplicate_rows(traj_id: Tensor, first_turn: Tensor, mask: Tensor, *, names: TrajNames | None = None) -> Tensor:
    """``[B]`` index of the earlier row each row copies (same trajectory and first turn), -1 if none.

    Raises ``ValueError`` when two rows share the key but not the response mask (naming the
    trajectory as ``names`` gives it, else by its integer id).
    """
    traj = torch.as_tensor(traj_id).long().cpu()
    first = torch.as_tensor(first_turn).long().cpu()
    B = traj.numel()
    if B == 0:
        return torch.zeros(0, dtype=torch.long)
    key = torch.stack([traj, first], 1)
    uniq, inv = torch.unique(key, dim=0, return_inverse=True)
    # first occurrence of every key: the smallest row index carrying it
    first_row = torch.full((uniq.shape[0],), B, dtype=torch.long).scatter_reduce_(0, inv, torch.arange(B), "amin")
    orig = first_row[inv]
    dup = torch.where(orig == torch.arange(B), torch.full_like(orig, -1), orig)
    rows = torch.nonzero(dup >= 0).flatten()
    if rows.numel():
        m = mask.bool().cpu()
        differ = (m[rows] != m[dup[rows]]).any(dim=1)
        if bool(differ.any()):
            r = int(rows[differ][0])
            who = names(r) if names is not None else f"trajectory {int(traj[r])}"
            raise ValueError(f"rows {int(dup[r])} and {r} share {who} and turn {int(first[r])} "
                             "but not their response masks: they are not copies")
    return dup


def _first_turn(turns: Tensor, mask: Tensor) -> Tensor:
    big = torch.iinfo(torch.long).max
    return torch.where(mask, turns, torch.full_like(turns, big)).amin(dim=1)


def _is_canonical(traj: Tensor, turn: Tensor, pos: Tensor) -> bool:
    """True if the tokens are already in non-decreasing (trajectory, turn, position) order."""
    if traj.numel() < 2:
        return True
    dt, du, dp = traj[1:] - traj[:-1], turn[1:] - turn[:-1], pos[1:] - pos[:-1]
    ok = (dt > 0) | ((dt == 0) & ((du > 0) | ((du == 0) & (dp >= 0))))
    return bool(ok.all())


def allocate_padded(
    *,
    advantage: Tensor,
    ratio: Tensor | float,
    delta: Tensor,
    response_mask: Tensor,
    traj_id: Tensor,
    turn_id: Tensor | None = None,
    turn_offset: Tensor | None = None,
    batch_id: int = 0,
    dedupe: bool = True,
    traj_names: TrajNames | None = None,
    settings: AllocatorSettings = DEFAULTS,
    **overrides: Any,
) -> PaddedAllocation:
    """Allocate one actor mini-batch held as padded ``[B, T]`` tensors.

    ``advantage`` may be ``[B]`` (per row) or ``[B, T]``; ``ratio`` and ``delta`` are
    ``[B, T]`` (``ratio`` may be a scalar 1.0 on a step's first mini-batch).
    ``traj_id`` is ``[B]`` integers.  ``turn_id`` is ``[B]`` (one turn per row) or ``[B, T]``;
    without it the runs of 1s of ``response_mask`` number the turns (plus
    ``turn_offset``).  ``settings`` fix the allocator (SPEC defaults); ``overrides`` (``allocator="sdar"``, ...)
    replace single settings.  A shape that fits
    neither the mask nor its rows, or a value that is not finite on a valid token, is a
    one-line :class:`~icsd_audit.integrations.checks.BatchInputError` naming the argument,
    the row and, with ``traj_names``, the user's own trajectory id.
    """
    mask = check_mask("response_mask", response_mask)
    B, T = mask.shape
    dev = mask.device
    turns = turn_ids_from_mask(mask, turn_offset) if turn_id is None else _row_turns(turn_id, mask)
    traj_t = torch.as_tensor(traj_id, device=dev)
    if traj_t.shape != (B,) or traj_t.is_floating_point() or traj_t.dtype == torch.bool:
        raise ValueError(f"traj_id must be {B} integers (one per row), got {traj_t.dtype} of shape "
                         f"{tuple(traj_t.shape)}")
    traj = traj_t.long()
    vals = {name: check_values(name, x, mask, names=traj_names, allow_scalar=True)
            for name, x in (("advantage", advantage), ("ratio", ratio), ("delta", delta))}

    dup = (duplicate_rows(traj, _first_turn(turns, mask), mask, names=traj_names) if dedupe
           else torch.full((B,), -1, dtype=torch.long))
    keep = mask & (dup.to(dev) < 0).view(-1, 1)
    pos = torch.where(mask, torch.cumsum(mask.long(), dim=1) - 1, torch.full((B, T), -1, dtype=torch.long, device=dev))

    # flat indices of the kept tokens, row-major; sorted into canonical order only when needed
    flat = torch.nonzero(keep.reshape(-1)).flatten()
    rows = torch.div(flat, T, rounding_mode="floor")
    tr, tu, ps = traj[rows], turns.reshape(-1)[flat], pos.reshape(-1)[flat]
    if not _is_canonical(tr, tu, ps):
        order = torch.from_numpy(np.lexsort((ps.cpu().numpy(), tu.cpu().numpy(), tr.cpu().numpy()))).to(dev)
        flat, rows, tr, tu = flat[order], rows[order], tr[order], tu[order]

    def pick(name: str) -> Tensor:
        t = vals[name].to(dev).detach()
        if t.dim() == 0:
            v = t.expand(flat.numel())
        elif t.dim() == 1:
            v = t[rows]
        else:
            v = t.reshape(-1)[flat]
        # float32 rounding first: the dump stores float32 and the audit recomputes from it
        return v.float().double()

    out = allocate(advantage=pick("advantage"), ratio=pick("ratio"), delta=pick("delta"), traj_id=tr, turn_id=tu,
                   batch_id=torch.full_like(rows, int(batch_id)), settings=settings.replace(**overrides))
    copies = torch.nonzero(dup >= 0).flatten().to(dev)
    originals = dup.to(dev)[copies]

    def back(x: Tensor) -> Tensor:
        full = torch.zeros(B * T, dtype=x.dtype, device=dev)
        full[flat] = x
        full = full.view(B, T)
        if copies.numel():
            full[copies] = full[originals]
        return full

    return PaddedAllocation(g=back(out.g), u=back(out.u), m=back(out.m), c=back(out.c), fallback=back(out.fallback),
                            turn_id=turns, pos=pos, duplicate_of=dup, diagnostics=out.diagnostics)


def mini_batch_ids(n_rows: int, *, mini_batch_rows: int, dp_size: int = 1) -> np.ndarray:
    """Global actor mini-batch index of every row, as verl partitions a step (no shuffling).

    verl (legacy ``dp_actor`` and v1 workers alike) hands each of ``dp_size`` ranks a
    contiguous chunk of the rows, and each rank cuts its chunk into consecutive
    mini-batches of ``mini_batch_rows // dp_size`` rows (``DataProto.split``: the last
    one may be short); global mini-batch ``k`` is the union of the ranks' ``k``-th
    pieces, and one optimizer step runs over it.  When ``n_rows`` does not divide by
    ``dp_size``, verl's auto-padding dispatch appends copies of the first rows so that
    every rank gets ``ceil(n_rows / dp_size)`` rows; the rows given here are placed as
    they are in that padded batch (the copies, which carry their original's ``c``, are
    not listed).
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    per_mini = int(mini_batch_rows) // int(dp_size)
    if per_mini < 1:
        raise ValueError(f"mini-batches of {mini_batch_rows} rows leave no row per rank on {dp_size} ranks")
    per_rank = -(-int(n_rows) // int(dp_size))
    return (np.arange(n_rows) % max(per_rank, 1)) // per_mini


# ------------------------------------------------------------------------------ settings and TCM


@dataclass(frozen=True)
class AllocationSettings(AllocatorSettings):
    """The allocator settings plus the distillation weight: what every engine integration takes (engines add
    their own fields). Being an :class:`~icsd_audit.alloc.settings.AllocatorSettings`, it is passed to the
    allocator as it is."""

    distill_coef: float = 0.01
    """lambda, the distillation weight (paper: 0.01)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        c = self.distill_coef
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not (math.isfinite(c) and c >= 0):
            raise ValueError(f"distill_coef must be a finite number >= 0, got {c!r}")

    @classmethod
    def from_run(cls, cfg: Any, **extra: Any) -> "AllocationSettings":
        """Every allocator setting of an ``icsd train`` run config (``TrainConfig.allocation``, the one list every
        engine takes its settings from) and lambda as deployed; ``extra``: an engine's own fields."""
        return cls(**cfg.allocation().to_dict(), distill_coef=cfg.effective_distill_coef, **extra)

    def allocator_settings(self) -> AllocatorSettings:
        """The allocator's eight settings alone (what the audit recomputes with)."""
        return AllocatorSettings(**{k: getattr(self, k) for k in SETTING_NAMES})

    def allocator_block(self, *, alloc_scope: str | None, ratio_source: str | None) -> dict[str, Any]:
        """The SPEC 9 ``allocator`` block an engine writes into each dump shard with these settings.

        ``alloc_scope`` (``mini-batch``, ``micro-batch``, ``global``) and ``ratio_source``
        (``prepass``, ``own-forward``, ``fixed-1`` or a sentence) are the engine's.
        """
        from icsd_audit.dumps.provenance import deployed_block

        return deployed_block(self.allocator_settings(), alloc_scope=alloc_scope, ratio_source=ratio_source,
                              **{"lambda": self.distill_coef})


def tcm_sums(w: Tensor, u: Tensor, delta: Tensor, mask: Tensor, eps: float = DEFAULTS.eps) -> tuple[float, float]:
    """(numerator, denominator) of SPEC 6's TCM of weights ``w`` over the masked tokens.

    Sums pool across mini-batches, so a step's TCM is ``sum num / sum den``.
    """
    sel = mask.bool() & (delta > 0) & (u.abs() > eps)
    return float(w[sel & (u < 0)].sum()), float(w[sel].sum())


def tcm(w: Tensor, u: Tensor, delta: Tensor, mask: Tensor, eps: float = DEFAULTS.eps) -> float:
    """SPEC 6 TCM of weights ``w`` over the masked tokens (NaN when no token qualifies): a training-time point
    estimate; ``icsd audit tcm`` gives the same number on the dumps, with bootstrap intervals."""
    num, den = tcm_sums(w, u, delta, mask, eps)
    return num / den if den > 0 else float("nan")


#: SPEC 6 sign regions of (delta, advantage), in icsd_audit.stats.results.REGIONS order.
_REGIONS = ("pos_delta_pos_adv", "pos_delta_neg_adv", "neg_delta_pos_adv", "neg_delta_neg_adv", "neutral")


def mechanism_sums(a: PaddedAllocation, advantage: Tensor, delta: Tensor, mask: Tensor, eps: float = DEFAULTS.eps
                   ) -> dict[str, float]:
    """Sums behind a step's mechanism metrics (:func:`mechanism_metrics`); they pool across mini-batches by addition.

    Per weighting (``c`` deployed, ``g`` SDAR's trust): TCM numerator and denominator,
    mass per SPEC 6 sign region and in all; plus the token and fallback-token counts.
    """
    m = mask.bool()
    adv = advantage if advantage.dim() == 2 else advantage.view(-1, 1).expand_as(delta)
    pos_d, neg_d, pos_a, neg_a = delta > 0, delta < 0, adv > 0, adv < 0
    regions = {"pos_delta_pos_adv": pos_d & pos_a, "pos_delta_neg_adv": pos_d & neg_a,
               "neg_delta_pos_adv": neg_d & pos_a, "neg_delta_neg_adv": neg_d & neg_a}
    regions["neutral"] = ~(pos_d | neg_d) | ~(pos_a | neg_a)
    out: dict[str, float] = {"tokens": float(m.sum()), "fallback": float((a.fallback.bool() & m).sum())}
    for name, w in (("c", a.c), ("g", a.g)):
        out[f"{name}/tcm_num"], out[f"{name}/tcm_den"] = tcm_sums(w, a.u, delta, m, eps)
        out[f"{name}/mass"] = float(w[m].sum())
        for r, sel in regions.items():
            out[f"{name}/{r}"] = float(w[m & sel].sum())
    return out


def mechanism_metrics(sums: dict[str, float], prefix: str = "icsd/") -> dict[str, float]:
    """``icsd/tcm`` (deployed c) and ``icsd/tcm_sdar`` (trust g), ``icsd/share/REGION`` and
    ``icsd/share_sdar/REGION`` (SPEC 6 shares of all valid mass), ``icsd/c_mass`` and ``icsd/g_mass``
    (total weight), ``icsd/fallback_share`` (share of tokens in the fallback set D) from pooled sums."""
    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else float("nan")

    out = {f"{prefix}tcm": ratio(sums["c/tcm_num"], sums["c/tcm_den"]),
           f"{prefix}tcm_sdar": ratio(sums["g/tcm_num"], sums["g/tcm_den"]),
           f"{prefix}c_mass": sums["c/mass"], f"{prefix}g_mass": sums["g/mass"],
           f"{prefix}fallback_share": ratio(sums["fallback"], sums["tokens"])}
    for side, name in (("c", "share"), ("g", "share_sdar")):
        out.update({f"{prefix}{name}/{r}": ratio(sums[f"{side}/{r}"], sums[f"{side}/mass"]) for r in _REGIONS})
    return out


# ------------------------------------------------------------------------------ loss


def distillation_token_loss(student_logp: Tensor, teacher_logp: Tensor, c: Tensor) -> Tensor:
    """``sg(c) * (sg(T) - logp)`` per token (Eq. sampled_aux weighted by the allocation)."""
    return c.detach().to(student_logp.dtype) * (teacher_logp.detach().to(student_logp.dtype) - student_logp)


def distillation_loss(student_logp: Tensor, teacher_logp: Tensor, c: Tensor, response_mask: Tensor, *,
                      loss_agg_mode: str = "token-mean", batch_num_tokens: float | Tensor | None = None,
                      global_batch_size: float | Tensor | None = None, dp_size: int = 1) -> Tensor:
    """The aggregated auxiliary loss, without lambda.

    ``token-mean`` with ``batch_num_tokens = |B|`` (the mini-batch's valid tokens over
    all data-parallel ranks) and ``dp_size`` is the paper's ``1/|B| * sum c (T - logp)``
    for any micro-batch split: each micro-batch contributes its partial sum, and
    data-parallel gradient averaging undoes the ``dp_size`` factor.  Without
    ``batch_num_tokens`` the local mask sum is used (one micro-batch = the mini-batch).
    The other modes follow verl's ``agg_loss`` definitions.
    """
    mask = response_mask.to(student_logp.dtype)
    lm = distillation_token_loss(student_logp, teacher_logp, c) * mask
    if loss_agg_mode == "token-mean":
        n = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return lm.sum() / n * dp_size
    if loss_agg_mode == "token-sum":
        return lm.sum() * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        per_row = lm.sum(-1)
        if loss_agg_mode == "seq-mean-token-mean":
            per_row = per_row / (mask.sum(-1) + 1e-8)
        has = (mask.sum(-1) > 0).to(lm.dtype)
        n = has.sum() if global_batch_size is None else global_batch_size
        return (per_row * has).sum() / n * dp_size
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: token-mean, token-sum, "
                     "seq-mean-token-sum, seq-mean-token-mean")


# ------------------------------------------------------------------------------ dumps


def dump_rows(alloc: PaddedAllocation, *, batch_id: int, traj_id: Tensor, advantage: Tensor, ratio: Tensor,
              delta: Tensor, response_mask: Tensor, extra: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Flat per-token dump columns of one padded mini-batch (copies left out), ready for ``DumpWriter.write``.

    Values are what entered the allocation (float32-rounded); ``g``, ``u``, ``m``, ``c``
    and ``fallback`` are the deployed outputs; ``extra`` holds further ``[B]`` or
    ``[B, T]`` columns (log-probs, env ids, ...).
    """
    mask = torch.as_tensor(response_mask).bool()
    B, T = mask.shape
    keep = mask & (alloc.duplicate_of.to(mask.device) < 0).view(-1, 1)
    rows, cols = torch.nonzero(keep, as_tuple=True)

    def pick(x: Any) -> np.ndarray:
        t = torch.as_tensor(x, device=mask.device)
        if t.dim() == 0:
            t = t.expand(B, T)
        elif t.dim() == 1:
            t = t.view(-1, 1).expand(B, T)
        t = t[rows, cols].detach().cpu()
        if t.is_floating_point():
            t = t.float()
        return t.numpy()

    out = {
        "batch_id": np.full(rows.numel(), int(batch_id), dtype=np.int64),
        "traj_id": pick(torch.as_tensor(traj_id).long()),
        "turn_id": pick(alloc.turn_id).astype(np.int32),
        "pos": pick(alloc.pos).astype(np.int32),
        "advantage": pick(advantage), "ratio": pick(ratio), "delta": pick(delta),
        "g": pick(alloc.g), "u": pick(alloc.u), "m": pick(alloc.m), "c": pick(alloc.c),
        "fallback": pick(alloc.fallback).astype(bool),
    }
    for k, v in (extra or {}).items():
        out[k] = pick(v)
    return out


def dump_writer(out_dir: str | Path, *, rank: int = 0, producer: Mapping[str, Any] | str = "icsd.integrations",
                metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """A :class:`~icsd_audit.dumps.writer.DumpWriter` for data-parallel rank ``rank``.

    Shards are named ``part-NNNNNN-r{rank:05d}.parquet`` by :class:`DumpWriter` (which never
    replaces an existing file) and the rank is stored in the shard metadata too.
    ``kwargs`` pass on (``allocation=`` the SPEC 9 block of :meth:`AllocationSettings.allocator_block`,
    ``world_size=``, ...).
    """
    from icsd_audit.dumps.writer import DumpWriter

    meta = {"rank": int(rank), **dict(metadata or {})}
    return DumpWriter(out_dir, producer=producer, rank=int(rank), metadata=meta, **kwargs)


def write_dump(writer: Any, alloc: PaddedAllocation, *, allocation: Mapping[str, Any] | None = None,
               **kwargs: Any) -> Path:
    """``dump_rows`` then one ``writer.write`` call (one shard per mini-batch).

    ``allocation``: this shard's SPEC 9 ``allocator`` block, when the writer was made without it.
    """
    cols = dump_rows(alloc, **kwargs)
    return writer.write(**cols) if allocation is None else writer.write(allocation=allocation, **cols)
