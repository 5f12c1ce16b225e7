"""Allocators against the loop reference, SPEC 4 guarantees, registry behaviour."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from icsd_audit.alloc.registry import AllocatorSpec, allocator_names, get_allocator, register_allocator
from icsd_audit.alloc.variants import allocate
from icsd_audit.alloc.segments import dense_ids, segment_median
from tests.alloc.reference_allocator import reference_allocate

torch.set_num_threads(1)

ALL = ["opsd", "sdar", "icsd", "fisher", "sign", "influence-only", "gaussian"]


def make_rows(seed: int, n_batches: int = 3) -> list[dict]:
    """Random batches with the corner cases the SPEC names, in shuffled row order."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    for b in range(n_batches):
        n_traj = 1 if b == 1 else int(rng.integers(2, 6))  # batch 1: one trajectory
        for t in range(n_traj):
            for q in range(int(rng.integers(1, 5))):
                n_tok = int(rng.integers(1, 9))  # groups often under 8 tokens
                adv = float(rng.choice([0.0, rng.normal(), -abs(rng.normal()), abs(rng.normal())]))
                if b == 2:
                    adv = 0.0  # all-zero influence batch
                for _ in range(n_tok):
                    delta = float(rng.choice([0.0, rng.standard_t(3), -abs(rng.normal()), 0.5]))
                    rows.append(dict(batch=b * 7, traj=t + 100, turn=q, A=adv,
                                     rho=float(np.exp(rng.normal(0, 0.05))), delta=delta,
                                     valid=bool(rng.random() > 0.1),
                                     score_norm=float(rng.choice([0.0, rng.uniform(0, 1.4142)]))))
        # a turn made only of fallback-set tokens
        rows += [dict(batch=b * 7, traj=999, turn=0, A=-1.0, rho=1.0, delta=-0.3 - 0.1 * k, valid=True,
                      score_norm=0.5) for k in range(4)]
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


def to_tensors(rows: list[dict], dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    return dict(
        batch_id=torch.tensor([r["batch"] for r in rows]),
        traj_id=torch.tensor([r["traj"] for r in rows]),
        turn_id=torch.tensor([r["turn"] for r in rows], dtype=torch.int32),
        advantage=torch.tensor([r["A"] for r in rows], dtype=dtype),
        ratio=torch.tensor([r["rho"] for r in rows], dtype=dtype),
        delta=torch.tensor([r["delta"] for r in rows], dtype=dtype),
        valid=torch.tensor([r["valid"] for r in rows]),
        score_norm=torch.tensor([r["score_norm"] for r in rows], dtype=dtype),
    )


def assert_close_rel(got: torch.Tensor, want: list[float], tol: float = 1e-10) -> None:
    w = torch.tensor(want, dtype=torch.float64)
    err = (got.double() - w).abs() / w.abs().clamp(min=1e-12)
    both_tiny = (got.double().abs() < 1e-12) & (w.abs() < 1e-12)
    assert float(torch.where(both_tiny, 0.0, err).max()) < tol


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("allocator", ALL)
@pytest.mark.parametrize("trust", ["laplace", "sigmoid"])
def test_matches_loop_reference(seed: int, allocator: str, trust: str) -> None:
    rows = make_rows(seed)
    out = allocate(**to_tensors(rows), allocator=allocator, trust=trust)
    ref = reference_allocate(rows, allocator=allocator, trust=trust)
    for key in ("g", "u", "m", "c"):
        assert_close_rel(getattr(out, key), [r[key] for r in ref])
    assert out.fallback.tolist() == [r["fallback"] for r in ref]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("allocator", ALL)
@pytest.mark.parametrize("trust", ["laplace", "sigmoid"])
def test_sorted_rows_allocate_batch_by_batch_like_the_reference(seed: int, allocator: str, trust: str) -> None:
    """Rows sorted by (batch, traj, turn) take the batch-by-batch path; the interleaved
    order of the same rows takes the all-batches segment path: both equal the loop reference,
    and their diagnostics agree."""
    rows = sorted(make_rows(seed), key=lambda r: (r["batch"], r["traj"], r["turn"]))
    ref = reference_allocate(rows, allocator=allocator, trust=trust)
    out = allocate(**to_tensors(rows), allocator=allocator, trust=trust)
    for key in ("g", "u", "m", "c"):
        assert_close_rel(getattr(out, key), [r[key] for r in ref])
    assert out.fallback.tolist() == [r["fallback"] for r in ref]
    order = np.random.default_rng(seed).permutation(len(rows))
    mixed = allocate(**to_tensors([rows[i] for i in order]), allocator=allocator, trust=trust)
    d_sorted, d_mixed = out.diagnostics.to_dict(), mixed.diagnostics.to_dict()
    for key, value in d_sorted.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(d_mixed[key]), key
        else:
            assert d_mixed[key] == pytest.approx(value, rel=1e-12), key
    assert d_sorted["n_batches"] == 3


def test_permuted_is_a_within_batch_shuffle_of_icsd_scores() -> None:
    rows = make_rows(5)
    t = to_tensors(rows)
    base = allocate(**t, allocator="icsd")
    perm = allocate(**t, allocator="permuted", seed=11)
    again = allocate(**t, allocator="permuted", seed=11)
    other = allocate(**t, allocator="permuted", seed=12)
    assert torch.equal(perm.c, again.c)
    assert not torch.equal(perm.m, other.m)
    live_c = t["valid"] & ~base.fallback
    mapping: dict[int, int] = {}
    for b in t["batch_id"].unique():
        sel = torch.nonzero(live_c & (t["batch_id"] == b)).squeeze(1)
        assert torch.equal(base.m[sel].sort().values, perm.m[sel].sort().values)
        src = sel[torch.argsort(base.m[sel], stable=True)]
        dst = sel[torch.argsort(perm.m[sel], stable=True)]
        mapping.update(zip(dst.tolist(), src.tolist()))
    fb = t["valid"] & base.fallback
    assert torch.equal(perm.m[fb], base.m[fb])
    ref = reference_allocate(rows, allocator="permuted", perm=mapping)
    assert_close_rel(perm.c, [r["c"] for r in ref])


def test_invalid_rows_are_zero_and_do_not_enter_statistics() -> None:
    rows = make_rows(7)
    t = to_tensors(rows)
    out = allocate(**t)
    inv = ~t["valid"]
    for key in ("g", "u", "m", "c"):
        assert float(getattr(out, key)[inv].abs().sum()) == 0.0
    assert not bool(out.fallback[inv].any())
    # Garbage in invalid rows changes nothing on the valid ones.
    t2 = dict(t)
    t2["delta"] = torch.where(inv, torch.tensor(1e6, dtype=torch.float64), t["delta"])
    out2 = allocate(**t2)
    assert torch.equal(out.c[~inv], out2.c[~inv])


def test_hand_worked_single_turn() -> None:
    # Eight tokens, one turn, one group: delta = [-2,-1,0,1,2,3,4,5], A = 1, rho = 1.
    # Trust: median 1.5; b- = mean(3.5,2.5,1.5,0.5) = 2; b+ = mean(.5,1.5,2.5,3.5) = 2.
    delta = torch.tensor([-2.0, -1, 0, 1, 2, 3, 4, 5], dtype=torch.float64)
    n = delta.numel()
    z = torch.zeros(n, dtype=torch.long)
    out = allocate(advantage=torch.ones(n, dtype=torch.float64), ratio=torch.ones(n, dtype=torch.float64),
                   delta=delta, traj_id=z, turn_id=z)
    g_first = 0.4 * math.exp((-2 - 1.5) / 2)
    g_last = 1 - 0.6 * math.exp(-(5 - 1.5) / 2)
    assert out.g[0].item() == pytest.approx(g_first, rel=1e-12)
    assert out.g[-1].item() == pytest.approx(g_last, rel=1e-12)
    # u = delta, same fit with eta = 0.5; no fallback tokens (A > 0), so sum c = sum g.
    m0 = 0.5 * math.exp(-3.5 / 2)
    assert out.m[0].item() == pytest.approx(m0, rel=1e-12)
    assert out.c.sum().item() == pytest.approx(out.g.sum().item(), rel=1e-12)
    assert out.diagnostics.fallback_share == 0.0


def test_degenerate_turn_keeps_trust() -> None:
    # All advantages zero -> u = 0 everywhere; the group fit is unusable (no spread)
    # and so is the batch fit -> fixed map: m = Phi(0; 0, 1, 1) = 1 - 0.5 = 0.5 > 0.
    n = 10
    z = torch.zeros(n, dtype=torch.long)
    delta = torch.linspace(-1, 1, n, dtype=torch.float64)
    out = allocate(advantage=torch.zeros(n, dtype=torch.float64), ratio=torch.ones(n, dtype=torch.float64),
                   delta=delta, traj_id=z, turn_id=z)
    assert torch.allclose(out.m, torch.full((n,), 0.5, dtype=torch.float64))
    assert torch.allclose(out.c, out.g)  # alpha = 2, c = 2 * g * 0.5
    assert out.diagnostics.groups_fixed_map == 1


def test_registry_rejects_duplicates_and_lists_names() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_allocator(AllocatorSpec("icsd", "trust", None, "dup"))
    with pytest.raises(ValueError, match="valid: .*icsd.*sdar"):
        get_allocator("nope")
    with pytest.raises(ValueError, match="unknown trust"):
        allocate(advantage=torch.ones(2), ratio=torch.ones(2), delta=torch.ones(2),
                 traj_id=torch.zeros(2, dtype=torch.long), turn_id=torch.zeros(2, dtype=torch.long), trust="bogus")
    assert set(ALL + ["permuted"]) == set(allocator_names())


def test_float32_agrees_with_float64() -> None:
    rows = make_rows(3, n_batches=4)
    out64 = allocate(**to_tensors(rows, torch.float64))
    out32 = allocate(**to_tensors(rows, torch.float32))
    assert out32.c.dtype == torch.float32
    assert torch.allclose(out32.c.double(), out64.c, rtol=1e-4, atol=1e-6)


def test_segment_median_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, 2000)
    vals = rng.choice([0.0, 1.0, 2.5], 2000) + rng.integers(0, 3, 2000)  # many ties
    dense, n = dense_ids(torch.from_numpy(ids))
    med = segment_median(torch.from_numpy(vals), dense, n)
    want = [np.median(vals[ids == k]) for k in np.unique(ids)]
    assert med.tolist() == want


# --- SPEC 4 guarantees as properties --------------------------------------------------

finite = st.floats(-50, 50, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def batches(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    n = draw(st.integers(1, 60))
    turn = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    traj = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    adv_turn = draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, 0.3, -2.5]), min_size=20, max_size=20))
    delta = draw(st.lists(st.one_of(finite, st.just(0.0)), min_size=n, max_size=n))
    ratio = draw(st.lists(st.floats(0.5, 2.0), min_size=n, max_size=n))
    score_norm = draw(st.lists(st.floats(0.0, 1.4142), min_size=n, max_size=n))
    return dict(
        traj_id=torch.tensor(traj), turn_id=torch.tensor(turn),
        advantage=torch.tensor([adv_turn[tr * 4 + tu] for tr, tu in zip(traj, turn)], dtype=torch.float64),
        ratio=torch.tensor(ratio, dtype=torch.float64), delta=torch.tensor(delta, dtype=torch.float64),
        score_norm=torch.tensor(score_norm, dtype=torch.float64),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.sampled_from(["icsd", "fisher", "sign", "influence-only", "gaussian", "permuted"]))
def test_exact_turn_mass_and_nonnegativity(b: dict[str, torch.Tensor], allocator: str) -> None:
    out = allocate(**b, allocator=allocator, seed=3)
    assert bool((out.c >= 0).all())
    turn_key = b["traj_id"] * 10 + b["turn_id"]
    for k in turn_key.unique():
        sel = turn_key == k
        assert out.c[sel].sum().item() == pytest.approx(out.g[sel].sum().item(), rel=1e-9, abs=1e-12)


# min_size 8: a batch of fewer than min_group tokens always takes the fixed map, which the
# assume() below filters out; drawing such batches only made Hypothesis's filter health check flaky
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(-400, 400)), min_size=8, max_size=80),
    st.sampled_from([0.25, 0.5, 2.0, 8.0]),
    st.integers(-40, 40),
)
def test_affine_invariance_of_scores(items: list[tuple[int, int]], a: float, shift: int) -> None:
    """Phi_G is fitted on u, so u -> a*u + b with a > 0 leaves m unchanged.

    u lives on a dyadic grid and a is a power of two, so the affine map, medians
    and one-sided means are exact in float64: the identity must hold bit for bit
    up to exp() rounding.  The floor eps scales with a as well (usability is a
    statement about the raw scales relative to eps).
    """
    from icsd_audit.alloc.layout import Layout
    from icsd_audit.alloc.scores import calibrated

    turn = torch.tensor([t for t, _ in items])
    u = torch.tensor([v / 8 for _, v in items], dtype=torch.float64)
    lay = Layout.build(torch.zeros_like(turn), torch.zeros_like(turn), turn)
    m1 = calibrated(u, lay, eta=0.5, eps=1e-4, min_group=8)
    m2 = calibrated(a * u + shift, lay, eta=0.5, eps=1e-4 * a, min_group=8)
    assume(m1.groups_fixed_map == 0)  # the fixed map is not fitted, hence not invariant
    assert torch.allclose(m1.m, m2.m, rtol=1e-12, atol=1e-15)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_ordering_at_equal_trust(b: dict[str, torch.Tensor]) -> None:
    out = allocate(**b, trust="uniform")  # g = 1 everywhere: equal trust
    turn_key = b["traj_id"] * 10 + b["turn_id"]
    for k in turn_key.unique():
        sel = (turn_key == k) & ~out.fallback
        u, c = out.u[sel], out.c[sel]
        order = torch.argsort(u, stable=True)
        assert bool((c[order].diff() >= -1e-12).all())


# --- fisher: the per-token score norm (SPEC 5, 2026-11-23) -----------------------------


def test_fisher_refuses_input_without_score_norm() -> None:
    t = to_tensors(make_rows(0))
    t.pop("score_norm")
    with pytest.raises(ValueError, match="score_norm"):
        allocate(**t, allocator="fisher")
    # the others ignore the column
    allocate(**t, allocator="icsd")


def test_fisher_no_longer_collapses_to_sdar_when_ratio_is_one() -> None:
    """With rho = 1 the old |A*rho| score was constant over each turn and matching gave c = g
    (the issue's 4e-16); with score_norm varying inside a turn, c differs from g."""
    rows = make_rows(4)
    for r in rows:
        r["rho"] = 1.0
    t = to_tensors(rows)
    out = allocate(**t, allocator="fisher")
    g = allocate(**t, allocator="sdar").c
    assert float((out.c - g).abs().max()) > 1e-3
    # and with a constant score_norm it collapses again (per-turn constant cancelled)
    t["score_norm"] = torch.full_like(t["score_norm"], 0.7)
    assert float((allocate(**t, allocator="fisher").c - g).abs().max()) < 1e-12


def test_fisher_hand_worked_single_turn() -> None:
    # one batch, one trajectory, one turn of 8 tokens (one calibration group, min_group 8),
    # A = 1, rho = 1, delta > 0 for all (no fallback), uniform trust g = 1.
    # x = |A rho| * s = s = [0.1, 0.2, ..., 0.8]; median = 0.45; b- = mean(0.35,0.25,0.15,0.05) = 0.2,
    # b+ = 0.2; m_j = 0.5 exp((x-0.45)/0.2) below, 1 - 0.5 exp(-(x-0.45)/0.2) above;
    # c = 8 * m / sum(m).
    s = [0.1 * k for k in range(1, 9)]
    m = [0.5 * math.exp((x - 0.45) / 0.2) if x < 0.45 else 1 - 0.5 * math.exp(-(x - 0.45) / 0.2) for x in s]
    want = [8 * v / sum(m) for v in m]
    out = allocate(advantage=torch.ones(8, dtype=torch.float64), ratio=torch.ones(8, dtype=torch.float64),
                   delta=torch.full((8,), 0.3, dtype=torch.float64), traj_id=torch.zeros(8, dtype=torch.long),
                   turn_id=torch.zeros(8, dtype=torch.long), allocator="fisher", trust="uniform",
                   score_norm=torch.tensor(s, dtype=torch.float64))
    assert out.c.tolist() == pytest.approx(want, rel=1e-12)
