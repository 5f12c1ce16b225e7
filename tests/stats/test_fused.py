"""Several statistics on one draw: their dense columns multiplied together (FusedDense) and their parts' counts
gathered in one pass, with each statistic's resampled sums the bits it gets alone (SPEC 7)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from icsd_audit.stats.engine import fused as fused_mod
from icsd_audit.stats.engine import resample
from icsd_audit.stats.engine.resample import Family, Layout, family_sums


def _families(lay: Layout, rng: np.random.Generator) -> list[np.ndarray]:
    """Sums (K x clusters) of families whose own panels take every shape the engine makes: a 4-row panel, a 5-row
    panel padded with a zero row, 11 columns (the last panel one row up), 12 (two full panels), one column (a
    product of one row), parts (columns on 2 % of the turns) beside dense columns, and a column two families share."""
    n = lay.n
    shared = rng.gamma(2.0, 1.0, n)

    def dense(k: int) -> np.ndarray:
        return rng.standard_normal((k, n)) * np.exp(3 * rng.standard_normal((k, 1)))

    four = dense(4)
    five = np.vstack([dense(4), shared, dense(2) * (rng.random(n) < 0.02)])  # 5 dense + 2 in parts
    eleven = np.vstack([shared, dense(10)])
    twelve = dense(12)
    one = dense(1)
    bins = rng.integers(0, 6, n)  # a share-shift-like family: 6 bins partition the turns, 2 columns each
    shift = np.zeros((12, n))
    shift[2 * bins, np.arange(n)] = rng.random(n)
    shift[2 * bins + 1, np.arange(n)] = rng.standard_normal(n)
    return [four, five, eleven, twelve, one, shift]


def _sums(lay: Layout, sums: list[np.ndarray], seed: int, n_res: int = 300) -> list[np.ndarray]:
    fams = [Family(S, np.zeros(lay.sizes.size, np.int64), 1, lay) for S in sums]
    out = [[] for _ in fams]
    for _, _, Ts in family_sums(lay, fams, n_res, seed=np.random.SeedSequence(seed)):
        for o, T in zip(out, Ts):
            o.append(T)
    return [np.concatenate(o) for o in out]


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(resample, "_PART_OVERHEAD", 0)  # parts on a small input, as on a large one


def test_each_statistic_keeps_the_bits_it_gets_alone(small_parts):
    rng = np.random.default_rng(3)
    lay = Layout([2500, 1700, 40, 2900])  # 7,140 clusters: three full tiles and a short last one
    sums = _families(lay, rng)
    fams = [Family(S, np.zeros(4, np.int64), 1, lay) for S in sums]
    assert [len(f.panels) for f in fams] == [1, 1, 2, 2, 1, 0]
    assert fams[1].parts and fams[5].parts and not fams[5].dense.size
    together = _sums(lay, sums, seed=11)
    for S, got in zip(sums, together):
        alone = _sums(lay, [S], seed=11)[0]  # one family: its own panels and its own gather
        assert got.tobytes() == alone.tobytes()
    # and the values: the counts themselves (sums = identity) times the sums, to rounding
    C = np.concatenate([T[:, 0, :] for T in _sums(lay, [np.eye(lay.n)], seed=11)])
    for S, got in zip(sums, together):
        assert np.allclose(got[:, 0, :], C @ S.T, rtol=1e-11, atol=1e-11 * np.abs(S).sum())


def test_the_engine_fuses_only_what_this_blas_gives_the_same_bits(small_parts, monkeypatch):
    rng = np.random.default_rng(5)
    lay = Layout([3000, 2100])
    sums = _families(lay, rng)
    fams = [Family(S, np.zeros(2, np.int64), 1, lay) for S in sums]
    eng = resample._Engine(lay, fams, np.random.SeedSequence(2))
    fused = eng.fused
    # the one-column family keeps its own product (one row: a matrix-vector product), the shift has no dense column
    assert fused is not None and fused.members == [0, 1, 2, 3]
    # the shared column is one fused row: 4 + 5 + 11 + 12 dense columns, 31 distinct
    assert fused.width == 31 and fused.rows_of[1][4] == fused.rows_of[2][0]
    assert all(q1 - q0 <= fused_mod.MAX_ROWS for q0, q1 in fused.panels)
    ref = eng.block(1)
    # a BLAS that gave a fused row other bits: the check says so and each family keeps its own panels
    calls = []
    real = np.matmul

    def odd(a, b, *args, **kw):  # a product of more than 12 rows rounds its last row differently
        out = real(a, b, *args, **kw)
        if a.ndim == 2 and a.shape[0] > 12:
            calls.append(a.shape[0])
            out[..., -1, :] = np.nextafter(out[..., -1, :], np.inf)
        return out

    monkeypatch.setattr(fused_mod.np, "matmul", odd)
    eng2 = resample._Engine(lay, fams, np.random.SeedSequence(2))
    assert eng2.fused is not None and not eng2.fused.verified(fams, resample.SUPER, resample.BLOCK)
    assert calls  # the check ran fused products
    assert eng2.fused.rows is None  # no fused rows held for products that will not run
    assert eng2.block(1).tobytes() == ref.tobytes()


def test_the_verdict_is_each_process_own(small_parts):
    rng = np.random.default_rng(8)
    lay = Layout([2000, 900])
    fams = [Family(S, np.zeros(2, np.int64), 1, lay) for S in _families(lay, rng)]
    eng = resample._Engine(lay, fams, np.random.SeedSequence(4))
    eng.block(0)
    assert eng.fused._verdict is True  # (this BLAS, checked in this process)
    copy = pickle.loads(pickle.dumps(eng))  # what a Ray worker receives
    assert copy.fused._verdict is None and copy.fused.rows is None  # (its rows are built where it is checked)
    assert copy.block(3).tobytes() == eng.block(3).tobytes()


def test_one_family_keeps_its_own_panels():
    lay = Layout([500, 700])
    fam = Family(np.random.default_rng(1).standard_normal((7, lay.n)), [0, 0], 1, lay)
    assert resample._Engine(lay, [fam], np.random.SeedSequence(0)).fused is None
