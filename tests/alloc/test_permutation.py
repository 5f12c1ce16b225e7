"""Bulk permutation controls equal the ``permuted`` allocator seed by seed."""

from __future__ import annotations

import torch

from icsd_audit.alloc.variants import allocate
from icsd_audit.alloc.permutation import permuted_coefficients
from tests.alloc.test_variants import make_rows, to_tensors

torch.set_num_threads(1)


def test_columns_equal_permuted_allocator_exactly() -> None:
    t = to_tensors(make_rows(9, n_batches=3))
    t.pop("score_norm")
    seeds = [0, 5, 17, 123]
    bulk = permuted_coefficients(**t, seeds=seeds)
    for j, s in enumerate(seeds):
        one = allocate(**t, allocator="permuted", seed=s).c
        assert torch.equal(bulk[:, j], one)


def test_permutation_controls_preserve_turn_mass() -> None:
    t = to_tensors(make_rows(2, n_batches=2))
    t.pop("score_norm")
    bulk = permuted_coefficients(**t, seeds=range(6))
    g = allocate(**t, allocator="sdar").g
    key = t["batch_id"] * 10_000 + t["traj_id"] * 10 + t["turn_id"]
    for k in key.unique():
        sel = key == k
        for j in range(6):
            assert bulk[sel, j].sum().item() == __import__("pytest").approx(g[sel].sum().item(), rel=1e-12, abs=1e-15)
