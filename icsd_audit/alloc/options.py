"""Allocator settings of an audit and the allocation of one batch of dump rows.

An audit recomputes what training deployed with the same allocator functions; this
module holds the settings it applies (SPEC defaults) and the one rule that lets a
SDAR-vs-X comparison allocate once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from icsd_audit.alloc.variants import EPS, MIN_GROUP, SIGMOID_BETA, Allocation, allocate

if TYPE_CHECKING:
    from icsd_audit.dumps.reader import TokenBatch

__all__ = ["AllocatorOptions", "allocate_batch", "batch_tensors", "weight_pair"]


@dataclass(frozen=True)
class AllocatorOptions:
    """The allocator settings an audit applies (SPEC defaults)."""

    allocator: str = "icsd"
    trust: str = "laplace"
    trust_beta: float = SIGMOID_BETA
    min_group: int = MIN_GROUP
    eps: float = EPS
    seed: int = 0

    def kwargs(self) -> dict[str, Any]:
        return dict(allocator=self.allocator, trust=self.trust, trust_beta=self.trust_beta,
                    min_group=self.min_group, eps=self.eps, seed=self.seed)


def batch_tensors(batch: TokenBatch) -> dict[str, torch.Tensor]:
    """The batch's required columns as CPU tensors (float64 values, int64 ids, bool valid)."""
    return {k: torch.from_numpy(v) for k, v in batch.arrays.items() if k != "pos"}


def allocate_batch(batch: TokenBatch, opts: AllocatorOptions) -> Allocation:
    """Allocate one batch in float64 on CPU."""
    a = batch_tensors(batch)
    return allocate(advantage=a["advantage"], ratio=a["ratio"], delta=a["delta"], traj_id=a["traj_id"],
                    turn_id=a["turn_id"], batch_id=a["batch_id"], valid=a["valid"], **opts.kwargs())


def weight_pair(batch: TokenBatch, base: AllocatorOptions, compare: AllocatorOptions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(base weights, compare weights, u) of one batch, each allocator computed once.

    SDAR's weights are the trust ``g`` of any non-OPSD allocation with the same trust
    settings, so the usual SDAR-vs-X comparison allocates once per batch.
    """
    first, second = sorted((compare, base), key=lambda o: o.allocator == "sdar")
    alloc = allocate_batch(batch, first)
    if second == first:
        w2 = alloc.c.numpy()
    elif second.allocator == "sdar" and first.allocator != "opsd" and replace(first, allocator="sdar", seed=second.seed) == second:
        w2 = alloc.g.numpy()
    else:
        w2 = allocate_batch(batch, second).c.numpy()
    w = {first: alloc.c.numpy(), second: w2}
    return w[base], w[compare], alloc.u.numpy()
