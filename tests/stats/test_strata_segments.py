"""The strata bootstrap's sorted-tile products (stats/engine/segments.py) against a slow reference, and beside tcm."""

from __future__ import annotations

import numpy as np
import pytest

from icsd_audit import Tokens, Weights, tcm
from icsd_audit.stats.engine import segments
from icsd_audit.stats.bootstrap import RatioFamily, bootstrap_ratio_families
from icsd_audit.stats.strata import StrataAccumulator, StrataSpec, strata_edges

from tests.stats.test_bootstrap import counts_matrix

SIZES = [40, 57, 90]  # turns per batch


def _turns(seed: int = 0) -> tuple[Tokens, Weights, np.ndarray]:
    """Turns of 1-30 tokens in batch order; most with one advantage, some mixed (u of both signs), some A = 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 31, sum(SIZES))
    n = int(lengths.sum())
    turn_of = np.repeat(np.arange(lengths.size), lengths)
    adv_turn = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], lengths.size)
    adv = adv_turn[turn_of]
    mixed = rng.random(lengths.size) < 0.15
    flip = mixed[turn_of] & (rng.random(n) < 0.5)
    adv = np.where(flip, -adv + 0.25, adv)
    delta = rng.normal(0, 1, n)
    delta[rng.random(n) < 0.1] = 0.0
    ratio = rng.uniform(0.5, 1.5, n)
    g = rng.uniform(0.1, 1.0, n)
    c = rng.uniform(0.0, 2.0, n) * (rng.random(n) < 0.9)
    batch = np.repeat(np.repeat(np.arange(len(SIZES)), SIZES), lengths)
    pos = np.arange(n) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    t = Tokens(advantage=adv, ratio=ratio, delta=delta, traj_id=turn_of, turn_id=np.zeros(n, dtype=np.int64),
               batch_id=batch, columns={"pos": pos})
    return t, Weights(g, c), turn_of


def _by_hand(t: Tokens, w: Weights, turn_of: np.ndarray, x: np.ndarray, edges: np.ndarray, R: int, seed: int):
    """Per resample, each bin's token share, mass shares and TCMs from explicitly resampled turns (Python loops)."""
    n_turns, nb = int(turn_of.max()) + 1, edges.size + 1
    V = np.zeros((n_turns, nb, 7))  # tokens, g, c, g over u < 0 active, g active, c over u < 0 active, c active
    for i in range(len(t)):
        b = sum(1 for e in edges if e <= x[i])
        u = t.advantage[i] * t.ratio[i] * t.delta[i]
        act = t.delta[i] > 0 and abs(u) > 1e-4
        row = V[turn_of[i], b]
        row += [1.0, w.base[i], w.compare[i], w.base[i] * (act and u < 0), w.base[i] * act,
                w.compare[i] * (act and u < 0), w.compare[i] * act]
    C = counts_matrix(SIZES, R, seed)  # each resample's multiplicity of every turn (the bootstrap's stream)
    S = np.einsum("rt,tbq->rbq", C, V)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"token_share": S[..., 0] / S[..., 0].sum(axis=1, keepdims=True),
                "share:base": S[..., 1] / S[..., 1].sum(axis=1, keepdims=True),
                "share:compare": S[..., 2] / S[..., 2].sum(axis=1, keepdims=True),
                "tcm:base": S[..., 3] / S[..., 4], "tcm:compare": S[..., 5] / S[..., 6]}


def _strata(*, seed: int, by: str, bins: int):
    """The random turns of ``seed``, their covariate, and the strata accumulator and family over them."""
    t, w, turn_of = _turns(seed=seed)
    x = t.columns["pos"].astype(float) if by == "pos" else np.abs(t.delta)
    spec = StrataSpec(by, bins=bins)
    acc = StrataAccumulator(spec=spec, edges=strata_edges(x, spec))
    acc.add(t, w, x=x)
    return t, w, turn_of, x, spec, acc, acc.family()


@pytest.mark.parametrize("by", ["pos", "abs_delta"])
def test_sorted_tiles_equal_resampled_turns_by_hand(monkeypatch, by):
    monkeypatch.setattr(segments, "TILE", 32)  # several tiles, each with its classes and ranges
    monkeypatch.setattr(segments, "WIDTH", 8)  # and ranges cut into several products
    t, w, turn_of, x, spec, acc, fam = _strata(seed=1, by=by, bins=6)
    (raw,) = bootstrap_ratio_families([fam], n_resamples=96, rng=7, keep_replicates=True)
    want = _by_hand(t, w, turn_of, x, acc.edges, 96, seed=7)
    for q, ref in want.items():
        for b in range(acc.n_bins):
            got = raw.replicates[:, 0, raw.index(f"{spec.name}:{b}:{q}")]
            assert np.array_equal(np.isnan(got), np.isnan(ref[:, b])), (q, b)
            ok = ~np.isnan(got)
            assert np.allclose(got[ok], ref[ok, b], rtol=1e-12, atol=1e-14), (q, b)
    # every class of turn occurred: numerators all 0, all equal to their denominators, and mixed
    cls = [p[1] for _, _, plan in segments.SegmentedFamily(np.ascontiguousarray(fam.sums.T), fam.column_groups,
                                                          fam.tied, _layout()).tiles for p in plan]
    assert set(cls) == {0, 1, 2, 3}


def _layout():
    from icsd_audit.stats.engine.resample import Layout

    return Layout(np.asarray(SIZES))


def test_sorted_tiles_agree_with_plain_products_and_leave_tcm_alone(monkeypatch):
    """The segmented family against the same columns multiplied densely (the last bits only), and tcm's interval is
    the same bits with a strata family bootstrapped beside it (each statistic's own products, SPEC 7)."""
    monkeypatch.setattr(segments, "TILE", 64)
    t, w, _ = _turns(seed=2)
    x = t.columns["pos"].astype(float)
    spec = StrataSpec("pos", bins=10)
    acc = StrataAccumulator(spec=spec, edges=strata_edges(x, spec))
    acc.add(t, w, x=x)
    fam = acc.family()
    plain = RatioFamily(fam.sums, fam.numerator_index, fam.denominator_index, strata=fam.strata,
                        differences=fam.differences, names=fam.names, totals=fam.totals)
    (a,) = bootstrap_ratio_families([fam], n_resamples=128, rng=3, keep_replicates=True)
    (b,) = bootstrap_ratio_families([plain], n_resamples=128, rng=3, keep_replicates=True)
    assert np.array_equal(a.estimate, b.estimate, equal_nan=True)
    assert np.allclose(a.replicates, b.replicates, rtol=1e-12, atol=1e-15, equal_nan=True)
    # tcm alone, and tcm's family beside the strata family on one draw: the same bits
    from icsd_audit.stats.accumulator import AuditAccumulator

    alone = tcm(t, w, n_resamples=128, rng=3)
    audit = AuditAccumulator(statistics=("tcm",))
    audit.add(t, w)
    (_, tfam), = audit.families()
    both = bootstrap_ratio_families([tfam, fam], n_resamples=128, rng=3, keep_replicates=True)
    for j, side in enumerate(("base", "compare", "diff")):
        ref = getattr(alone, side)
        assert (both[0].estimate[0, j], both[0].ci_low[0, j], both[0].ci_high[0, j]) == (
            ref.estimate, ref.ci_low, ref.ci_high)
    assert np.array_equal(both[1].replicates, a.replicates, equal_nan=True)


@pytest.mark.parametrize("by", ["pos", "abs_delta"])
def test_half_panels_change_no_bit(monkeypatch, by):
    """Panels split in two wherever it pays (here: always, a product costing nothing) against whole panels: each
    row is multiplied over a range holding all its nonzero clusters either way, so the same bits; and the split
    panels against the slow reference."""
    monkeypatch.setattr(segments, "TILE", 64)
    t, w, turn_of, x, spec, acc, fam = _strata(seed=3, by=by, bins=10)
    runs = {}
    for call_cost in (10**9, 0):  # never split, split wherever a half is narrower
        monkeypatch.setattr(segments, "_CALL_COST", call_cost)
        sf = segments.SegmentedFamily(np.ascontiguousarray(fam.sums.T), fam.column_groups, fam.tied, _layout())
        runs[call_cost] = (sum(len(plan) for _, _, plan in sf.tiles),
                           bootstrap_ratio_families([fam], n_resamples=96, rng=5, keep_replicates=True)[0])
    (whole_n, whole), (split_n, split) = runs[10**9], runs[0]
    assert split_n > whole_n  # some panels were split
    assert whole.replicates.tobytes() == split.replicates.tobytes()
    want = _by_hand(t, w, turn_of, x, acc.edges, 96, seed=5)
    for q, ref in want.items():
        for b in range(acc.n_bins):
            got = split.replicates[:, 0, split.index(f"{spec.name}:{b}:{q}")]
            ok = ~np.isnan(got)
            assert np.array_equal(ok, ~np.isnan(ref[:, b])) and np.allclose(got[ok], ref[ok, b], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("by", ["pos", "abs_delta"])
def test_donated_sums_sorted_in_place_give_the_same_bits(monkeypatch, by):
    """A donated family (the engine sorts its matrix in place, no copy) against the same family copied: the same
    replicates bit for bit, every class of turn present (mixed ones read their numerators from the sorted rows);
    the donated matrix was reordered, the other left as it was."""
    monkeypatch.setattr(segments, "TILE", 32)
    monkeypatch.setattr(segments, "WIDTH", 8)
    t, w, turn_of, x, spec, acc, fam = _strata(seed=4, by=by, bins=6)
    kept = np.array(fam.sums, copy=True)
    mine = np.array(fam.sums.T, copy=True)  # (columns, turns), as the accumulator lays its matrix out
    donated = RatioFamily(mine.T, fam.numerator_index, fam.denominator_index, strata=fam.strata,
                          differences=fam.differences, names=fam.names, totals=fam.totals,
                          column_groups=fam.column_groups, tied=fam.tied, donate=True)
    (a,) = bootstrap_ratio_families([fam], n_resamples=96, rng=9, keep_replicates=True, workers=2)
    (b,) = bootstrap_ratio_families([donated], n_resamples=96, rng=9, keep_replicates=True, workers=2)
    assert a.replicates.tobytes() == b.replicates.tobytes()
    assert np.array_equal(fam.sums, kept)  # not donated: untouched
    assert not np.array_equal(mine, kept.T)  # donated: sorted where it lay, the token counts packed two to a row
    assert (mine >= segments._PACK).any() and not (kept >= segments._PACK).any()
    want = _by_hand(t, w, turn_of, x, acc.edges, 96, seed=9)
    for q, ref in want.items():
        for bin_ in range(acc.n_bins):
            got = b.replicates[:, 0, b.index(f"{spec.name}:{bin_}:{q}")]
            ok = ~np.isnan(got)
            assert np.array_equal(ok, ~np.isnan(ref[:, bin_])) and np.allclose(got[ok], ref[ok, bin_], rtol=1e-12,
                                                                               atol=1e-14)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [1, 2, 3, 4, 0], [2, 0, 1, 4, 3], [0, 2, 1, 3, 4]])
def test_rows_sorted_in_place_match_a_fancy_index(rows):
    """The in-place sort against the copy NumPy's indexing makes: row i holds row rows[i], each sorted by the order
    (identity, reversal, one long cycle, two cycles, one swap), with one and two threads."""
    rng = np.random.default_rng(0)
    ST = rng.normal(size=(5, 37))
    order = rng.permutation(37)
    for workers in (1, 2):
        got = ST.copy()
        segments._sort_in_place(got, order, rows, workers)
        assert np.array_equal(got, ST[rows][:, order])


@pytest.mark.parametrize("expected_rows", [1, 10**6])
def test_reserved_matrix_gives_the_same_family_and_bits(expected_rows):
    """Per-turn sums copied into one reserved matrix as batches come (its capacity far too small, so grown twice
    and more, or far too large, so its rows are spaced wider than their length) against the list of pieces
    copied at the end: the same columns, and the same replicates bit for bit from the donated family; batches
    added directly and merged from parts, reserved or not."""
    t, w, _ = _turns(seed=6)
    x = np.abs(t.delta)
    spec = StrataSpec("abs_delta", bins=6)
    edges = strata_edges(x, spec)
    batch = np.asarray(t.batch_id)
    pieces = [np.flatnonzero(batch == b) for b in range(len(SIZES))]

    def sub(rows: np.ndarray) -> tuple[Tokens, Weights, np.ndarray]:
        tk = Tokens(advantage=t.advantage[rows], ratio=t.ratio[rows], delta=t.delta[rows], traj_id=t.traj_id[rows],
                    turn_id=t.turn_id[rows], batch_id=batch[rows])
        return tk, Weights(w.base[rows], w.compare[rows]), x[rows]

    plain = StrataAccumulator(spec=spec, edges=edges)
    kept = StrataAccumulator(spec=spec, edges=edges)
    kept.reserve(expected_rows)
    tk, wk, xk = sub(pieces[0])
    plain.add(tk, wk, x=xk)
    kept.add(tk, wk, x=xk)
    with pytest.raises(ValueError, match="before adding"):
        plain.reserve(5)
    for i, rows in enumerate(pieces[1:], 1):
        tk, wk, xk = sub(rows)
        plain.add(tk, wk, x=xk)
        part = kept.part()
        if i == 2:
            part.reserve(3)  # a reserved part merges too
        part.add(tk, wk, x=xk)
        kept.merge(part)
    a, b = plain.family(), kept.family(donate=True)
    assert np.array_equal(a.sums, b.sums)
    if expected_rows > 1:
        assert b.sums.T.strides[0] > b.sums.shape[0] * 8  # rows spaced wider than their length: used in place
    donated_a = RatioFamily(np.array(a.sums.T).T, a.numerator_index, a.denominator_index, strata=a.strata,
                            differences=a.differences, names=a.names, totals=a.totals,
                            column_groups=a.column_groups, tied=a.tied)
    (ra,) = bootstrap_ratio_families([donated_a], n_resamples=64, rng=2, keep_replicates=True)
    (rb,) = bootstrap_ratio_families([b], n_resamples=64, rng=2, keep_replicates=True, workers=2)
    assert ra.replicates.tobytes() == rb.replicates.tobytes()
    assert np.array_equal(ra.estimate, rb.estimate, equal_nan=True)


def test_packable_pairs_take_whole_numbers_within_the_tile_bound(monkeypatch):
    """Columns packed two to a row: whole numbers >= 0 whose sum over every tile, times the largest count (127),
    stays below 2**26, paired in group order; fractional, negative and too large columns stay apart."""
    monkeypatch.setattr(segments, "TILE", 4)
    limit = (2**26 - 1) // 127  # the largest tile sum that packs
    ST = np.array([
        [1, 2, 3, 4, 5, 6, 7, 8],  # 0: counts
        [1.5, 2, 3, 4, 5, 6, 7, 8],  # 1: a fraction (in the first values)
        [0, 0, 0, 0, 0, 0, 0, 0],  # 2: zeros pack
        [1, 1, 1, 1, 1, 1, 1, -1],  # 3: negative (past the first values checked alone)
        [limit, 0, 0, 0, 0, 0, 0, 0],  # 4: at the bound
        [limit, 1, 0, 0, 0, 0, 0, 0],  # 5: one past it in the first tile
        [0, 0, 0, 0, 0, 0, 0, limit + 1],  # 6: one past it in the last tile
        [3, 0, 0, 1, 0, 2, 0, 9],  # 7: counts
        [9, 9, 9, 9, 9, 9, 9, 9],  # 8: counts, left alone (odd one out)
    ], dtype=np.float64)
    assert segments._packable_pairs(ST, [[0, 1, 2], [3, 4, 5], [6, 7, 8]]) == [(0, 2), (4, 7)]
    assert segments._packable_pairs(ST, [[8, 7], [0]]) == [(8, 7)]  # group order decides the pairs
    assert segments._packable_pairs(ST[:, :0], [[0, 2]]) == []


def test_packed_counts_are_exact_across_many_tiles(monkeypatch):
    """Large token counts packed two to a row against the products worked out in integers (int64, exact): every
    sum the same number, so the same bits as multiplying them apart; the packed halves are split tile by tile
    (the counts' whole sums here are far above 2**26, so one split at the end would mix them).  A column past the
    bound is multiplied alone, and the float columns beside them are the bits of the family built without
    packing."""
    from icsd_audit.stats.engine.counts import BLOCK
    from icsd_audit.stats.engine.resample import SUPER, Layout

    monkeypatch.setattr(segments, "TILE", 32)
    rng = np.random.default_rng(11)
    n = 32 * 400
    big = (2**26 - 1) // 127 // 32  # each tile's sum at most 32 * big: within the bound
    ints = rng.integers(0, big + 1, size=(5, n)).astype(np.float64)
    ints[4, 5] = 32 * big + 1  # past the bound in its tile: not packed
    floats = rng.normal(size=(2, n))
    ST = np.ascontiguousarray(np.vstack([ints[:2], floats[:1], ints[2:], floats[1:]]))  # columns 0-1, 3-5 whole
    groups = [[0, 1, 2], [3, 4], [5, 6]]
    counts = rng.integers(0, 6, size=(SUPER, n, BLOCK)).astype(np.int8)
    counts[0, 7, 3] = 127  # the largest count
    lay = Layout([n])
    fam = segments.SegmentedFamily(ST, groups, [], lay)
    assert fam.packed[2:] == ([0, 3], [1, 4])  # column 5 past the bound; the floats never pack
    got = fam.unit_sums(counts)  # (SUPER * BLOCK, columns)
    want = np.einsum("jtr,ct->jrc", counts.astype(np.int64), ST[[0, 1, 3, 4, 5]].astype(np.int64))
    assert (want.reshape(-1, 5) > 2**26).any()
    assert np.array_equal(got[:, [0, 1, 3, 4, 5]], want.reshape(-1, 5).astype(np.float64))
    monkeypatch.setattr(segments, "_packable_pairs", lambda ST, plain: [])
    apart = segments.SegmentedFamily(ST, groups, [], lay)
    assert apart.packed[2] == []
    assert apart.unit_sums(counts).tobytes() == got.tobytes()


@pytest.mark.parametrize("seed", range(6))
def test_panels_add_each_live_row_once_in_panels_of_12_or_6(monkeypatch, seed):
    """Random segments (rows zero on the segment, rows with ranges of their own): every row with a nonzero range is
    added by exactly one product, whose range holds the row's; rows zero on the segment are never added; each
    product multiplies 12 or 6 rows inside the array (all of them where it holds fewer than 6)."""
    monkeypatch.setattr(segments, "_CALL_COST", 10**9 if seed % 2 else 0)  # whole panels, or halves wherever narrower
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 60))
    lo = rng.integers(0, 50, total)
    hi = lo + rng.integers(1, 50, total)
    dead = rng.random(total) < rng.choice([0.0, 0.3, 0.8])
    lo[dead], hi[dead] = 100, 0
    added = np.zeros(total, dtype=int)
    for p0, k0, p1, a, z in segments._panels(lo, hi):
        assert 0 <= p0 <= k0 < p1 <= total and p1 - p0 in ({12, 6} if total >= 6 else {total})
        rows = np.arange(k0, p1)
        added[rows] += 1
        live = rows[~dead[rows]]
        assert (lo[live] >= a).all() and (hi[live] <= z).all()
    assert (added[~dead] == 1).all() and (added[dead] <= 1).all()


def test_panels_of_a_run_of_45_rows_and_of_27():
    """45 rows nonzero over the whole segment: four panels of 12, the last starting 3 rows early and adding 9; 27
    rows: two of 12 and one of 6 that takes 3 rows past the run (zero there)."""
    full = segments._panels(np.zeros(45, dtype=int), np.full(45, 7))
    assert full == [(0, 0, 12, 0, 7), (12, 12, 24, 0, 7), (24, 24, 36, 0, 7), (33, 36, 45, 0, 7)]
    lo, hi = np.full(40, 9), np.zeros(40, dtype=int)
    lo[:27], hi[:27] = 0, 7
    assert segments._panels(lo, hi) == [(0, 0, 12, 0, 7), (12, 12, 24, 0, 7), (24, 24, 30, 0, 7)]
