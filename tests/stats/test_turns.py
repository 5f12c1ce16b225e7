"""Token-side helpers of the per-turn reduction: the same bits as their plain numpy forms."""

from __future__ import annotations

import numpy as np
import pytest

from icsd_audit.stats.accumulator import _splus_clusters
from icsd_audit.stats.turns import ClusterIndex, factorize, masked


def test_masked_is_np_where_bit_for_bit():
    rng = np.random.default_rng(0)
    for signed in (False, True):
        w = rng.random(5000)
        w[::5] = 0.0
        if signed:  # -0.0 * 0 = -0.0 and x * 0 = -0.0 for x < 0: np.where gives +0.0 there
            w[::7] = -0.0
            w[::9] = -rng.random(w[::9].size)
        m = rng.random(5000) < 0.5
        want = np.where(m, w, 0.0)
        assert masked(w, m).tobytes() == want.tobytes()
        assert masked(w, m, np.full(5000, 7.0)).tobytes() == want.tobytes()


def test_count_where_counts_each_cluster():
    rng = np.random.default_rng(1)
    runs = np.repeat(np.arange(40), rng.integers(1, 30, 40))  # turns arrive as runs (reduceat path)
    for keys in (runs, rng.permutation(runs)):  # and interleaved (bincount path)
        cidx = ClusterIndex(keys)
        mask = rng.random(keys.size) < 0.3
        ids = cidx.ids()
        want = np.array([mask[ids == c].sum() for c in range(cidx.n)])
        got = cidx.count_where(mask)
        assert got.dtype == np.int32 and np.array_equal(got, want)


def test_splus_clusters_equal_the_two_key_clusters():
    # the shortcut (advantage constant over each turn) must give the clusters, order and sums of
    # ClusterIndex(turn, advantage); changing advantages and interleaved turns take the general path
    rng = np.random.default_rng(2)
    cl = np.repeat(np.arange(50), rng.integers(1, 20, 50))
    a = rng.normal(size=50)[cl]
    a[cl == 3] = np.where(np.arange((cl == 3).sum()) % 2, 0.0, -0.0)  # +0.0 and -0.0 are one value
    changing = a.copy()
    changing[cl == 7] = np.arange((cl == 7).sum())
    perm = rng.permutation(cl.size)
    v = rng.random(cl.size)
    for c, x, vv in ((cl, a, v), (cl, changing, v), (cl[perm], a[perm], v[perm])):
        ref = ClusterIndex(c, factorize(x)[0])
        got = _splus_clusters(c, x)
        assert got.n == ref.n and np.array_equal(got.first, ref.first)
        assert got.sum(vv).tobytes() == ref.sum(vv).tobytes()
        assert np.array_equal(got.count(), ref.count())


def _shared_turns_tokens(shuffled: bool):
    from icsd_audit.tokens import Tokens, Weights

    rng = np.random.default_rng(11)
    n = 600
    traj = np.repeat(np.arange(50), 12)
    turn = np.tile(np.repeat([0, 1, 2], 4), 50)
    order = rng.permutation(n) if shuffled else np.arange(n)  # shuffled: turns are not runs (the sorted path)
    adv = np.repeat(rng.normal(size=150), 4)[order]
    delta = rng.normal(size=n)
    delta[rng.choice(n, 9, replace=False)] = 0.0
    tokens = Tokens(advantage=adv, ratio=rng.uniform(0.5, 1.6, n), delta=delta, traj_id=traj[order],
                    turn_id=turn[order], batch_id=np.repeat([3, 4], n // 2), valid=rng.random(n) > 0.15)
    return tokens, Weights(rng.random(n), rng.random(n) * 2, base_name="sdar", compare_name="icsd")


@pytest.mark.parametrize("shuffled", [False, True])
def test_a_shared_turn_index_gives_every_accumulator_the_same_sums(shuffled: bool) -> None:
    """turn_index(tokens) passed as ``turns`` to the audit, sign and landscape accumulators: the same per-turn
    sums, bit for bit, as each building its own index (what the report's stream relies on)."""
    from icsd_audit.stats.accumulator import AuditAccumulator
    from icsd_audit.stats.landscape import LandscapeAccumulator, LandscapeRanks
    from icsd_audit.stats.signs import SignSharesAccumulator
    from icsd_audit.stats.turns import turn_index

    tokens, w = _shared_turns_tokens(shuffled)
    turns = turn_index(tokens)
    assert turns.n_rows == int(tokens.valid.sum())
    ranks = LandscapeRanks(grid=5)
    ranks.add(tokens.delta, tokens.advantage, valid=tokens.valid)
    edges = ranks.finalize()
    for make in (lambda: AuditAccumulator(), lambda: SignSharesAccumulator(names=("sdar", "icsd")),
                 lambda: LandscapeAccumulator(grid=5, ranks=edges)):
        own, shared = make(), make()
        own.add(tokens, w)
        shared.add(tokens, w, turns=turns)
        fo, fs = ([own.family()], [shared.family()]) if isinstance(own, SignSharesAccumulator) else (
            [f for _, f in own.families()], [f for _, f in shared.families()])
        assert len(fo) == len(fs) >= 1
        for a, b in zip(fo, fs):
            assert np.array_equal(np.asarray(a.sums), np.asarray(b.sums)) and np.array_equal(a.strata, b.strata)
        with pytest.raises(ValueError, match="valid rows"):
            make().add(tokens, w, turns=ClusterIndex(np.zeros(3, np.int64)))


@pytest.mark.parametrize("once", [True, False])
def test_bin_sums_are_bincounts(once: bool) -> None:
    """The share shift's per-turn bin sums: bincount's bits, with each cluster once (put in place, -0.0 made +0.0
    as 0.0 + -0.0 is) and with clusters repeated (summed in order)."""
    from icsd_audit.stats.turns import bin_sums

    rng = np.random.default_rng(4)
    cluster = np.sort(rng.choice(5000, 900, replace=False)) if once else np.sort(rng.integers(0, 5000, 900))
    values = rng.random(900) * 1e3
    values[::7] = -0.0
    bins = rng.integers(0, 11, 900)
    got = np.zeros((11, 5000))
    bin_sums(cluster, values, bins, out=list(got))
    for i in range(11):
        want = np.bincount(cluster[bins == i], weights=values[bins == i], minlength=5000)
        assert np.array_equal(got[i].view(np.int64), want.view(np.int64)), i  # (the bits, signs of zeros included)


def test_families_release_hook_runs_once_per_statistic_after_its_pieces_are_dropped() -> None:
    """``families(released=...)`` (the report hands freed heap pages back there): called once per statistic, each
    time with that statistic's per-batch pieces gone, and the families the same bits as without it."""
    from icsd_audit.stats.accumulator import AuditAccumulator

    tokens, w = _shared_turns_tokens(False)
    plain, hooked = AuditAccumulator(), AuditAccumulator()
    plain.add(tokens, w)
    hooked.add(tokens, w)
    left: list[set[str]] = []
    want = [f for _, f in plain.families()]
    got = [f for _, f in hooked.families(released=lambda: left.append(set(hooked._cols)))]
    assert len(left) == len(got) == len(want) == len(hooked.statistics) == 4
    # the pieces left after each statistic: fewer each time, that statistic's own gone (TCM's first; the weight
    # totals only after clipping, their last user), and no weighted sum at all after the last
    assert all(b < a for a, b in zip(left, left[1:]))
    assert "tcm_num_b" not in left[0] and "total_b" in left[2] and "total_b" not in left[3]
    assert all(k.endswith("_n") for k in left[-1])
    for a, b in zip(want, got):
        assert np.asarray(a.sums).tobytes() == np.asarray(b.sums).tobytes()
        assert (a.numerator_index, a.denominator_index, a.names) == (b.numerator_index, b.denominator_index, b.names)
