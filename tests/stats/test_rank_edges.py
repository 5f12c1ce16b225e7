"""The landscape's delta edges from unsorted values (a bucket histogram) against the sorted-values rule."""

from __future__ import annotations

import numpy as np
import pytest

from icsd_audit.stats.rank_edges import unsorted_value_edges, value_edges


def _cases() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    out = [rng.normal(size=20_000).astype(np.float32), rng.normal(scale=1e-3, size=5_000),  # float32, float64
           np.round(rng.normal(size=30_000), 1).astype(np.float32),  # heavy ties
           np.zeros(1_000, np.float32), np.array([2.5], np.float32), np.array([-1.0, 3.0]),
           np.full(4_000, 1.5, np.float32), rng.exponential(size=9_000).astype(np.float32)]
    mixed = rng.normal(size=12_000).astype(np.float32)
    mixed[::5] = 0.0
    mixed[1::5] = -0.0  # counted as 0.0, as a comparison counts it
    mixed[2::50] = np.float32(1e-42)  # subnormals beside zero
    out.append(mixed)
    near = (1.0 + rng.integers(0, 40, 50_000) * np.finfo(np.float32).eps).astype(np.float32)  # one bucket
    out.append(np.concatenate([near, -near[:3_000]]))
    return out


@pytest.mark.parametrize("case", range(10))
@pytest.mark.parametrize("grid", [1, 3, 20, 64])
def test_unsorted_edges_equal_the_sorted_rule(case: int, grid: int) -> None:
    values = _cases()[case]
    want = value_edges(np.sort(values), None, grid)
    got = unsorted_value_edges(values.copy(), grid)
    assert got[0].dtype == np.float64 and got[0].shape == want[0].shape == (grid - 1,)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1] and got[2] == want[2]


def test_other_dtypes_are_sorted() -> None:
    values = np.array([3, 1, 2, 2, 5], dtype=np.int64)
    assert all(np.array_equal(a, b) for a, b in zip(unsorted_value_edges(values.copy(), 4),
                                                     value_edges(np.sort(values), None, 4)))
