"""The segment layout of a batch of tokens: which rows are valid, and their batch, group, turn ids.

Invalid tokens are dropped up front (they enter no fit) and come back as zeros; statistics are segment
reductions keyed by (batch), (batch, turn) and (batch, trajectory, turn), built here once per call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from icsd_audit.alloc.segments import combine_ranks, dense_rank
from icsd_audit.tokens import Tokens

__all__ = ["Layout", "ValidTokens", "sorted_runs", "token_tensors"]


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
        runs = sorted_runs(batch_id, traj_id, turn_id)
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


def sorted_runs(*keys: Tensor) -> Tensor | None:
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
