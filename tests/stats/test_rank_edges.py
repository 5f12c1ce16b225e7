"""The landscape's delta edges from unsorted values (a bucket histogram) against the sorted-values rule, and NumPy's
linear quantile from a few order statistics against NumPy's own."""

from __future__ import annotations

import numpy as np
import pytest

from icsd_audit.stats.rank_edges import linear_quantiles, order_statistics, unsorted_value_edges, value_edges


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


def _quantile_cases() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    wide = rng.normal(size=100_000) * 10.0 ** rng.integers(-300, 300, 100_000)  # keys over most of float64's range
    zeros = np.where(rng.random(150_000) < 0.4, 0.0, rng.normal(size=150_000)).astype(np.float32)
    return [np.abs(rng.normal(size=200_001)).astype(np.float32),  # |delta|: float32, a histogram bucket per range
            rng.normal(size=70_000),  # float64, negatives
            rng.integers(0, 300, 400_000).astype(np.int32),  # positions: one key per bucket, no second pass
            rng.integers(-2**62, 2**62, 66_000),  # int64 over most of its range
            np.round(rng.normal(size=300_000), 1),  # heavy ties inside buckets
            np.full(80_000, 3.25), wide, zeros,
            rng.integers(-10**9, 10**9, 90_000).astype(np.int32),
            rng.normal(size=1_000).astype(np.float32)]  # small: NumPy itself


@pytest.mark.parametrize("case", range(10))
def test_linear_quantiles_are_numpys_bits(case: int) -> None:
    values = _quantile_cases()[case]
    qs = [k / 10 for k in range(1, 10)] + [0.0, 1.0, 0.8, 1 / 3, 0.999999]
    ref = np.quantile(values.astype(np.float64), qs, method="linear")
    got = linear_quantiles(values.copy(), qs)
    assert got.dtype == np.float64 and got.tobytes() == ref.tobytes()
    ranks = np.random.default_rng(case).integers(0, values.size, 25)
    assert np.array_equal(order_statistics(values, ranks), np.sort(values)[ranks])


@pytest.mark.parametrize("case", range(9))
def test_chunks_on_threads_give_the_same_bits(monkeypatch, case: int) -> None:
    """Both passes in chunks of 4,096 values on two threads (as ``icsd audit strata`` runs them): NumPy's bits."""
    from icsd_audit.stats import rank_edges

    monkeypatch.setattr(rank_edges, "_CHUNK", 4096)
    values = _quantile_cases()[case]
    qs = [k / 10 for k in range(1, 10)] + [0.0, 1.0, 0.8]
    ref = np.quantile(values.astype(np.float64), qs, method="linear")
    assert linear_quantiles(values.copy(), qs, workers=2).tobytes() == ref.tobytes()
    ranks = np.random.default_rng(case).integers(0, values.size, 25)
    assert np.array_equal(order_statistics(values, ranks, workers=2), np.sort(values)[ranks])


def test_linear_quantiles_leave_other_input_to_numpy() -> None:
    x = np.random.default_rng(3).normal(size=70_000)
    x[5] = np.nan
    assert np.isnan(linear_quantiles(x, [0.5])).all()  # NumPy's answer with a NaN
    b = np.random.default_rng(4).random(70_000) < 0.3
    assert linear_quantiles(b, [0.5, 0.9]).tolist() == np.quantile(b.astype(np.float64), [0.5, 0.9]).tolist()
    assert order_statistics(b, [0]) is None
