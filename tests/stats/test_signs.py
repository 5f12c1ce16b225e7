"""Share of mass by the sign of delta (``icsd_audit.stats.signs``) against loops over the tokens."""

from __future__ import annotations

import numpy as np
import pytest

from icsd_audit.stats.bootstrap import bootstrap_ratio_families
from icsd_audit.stats.signs import SignSharesAccumulator, sign_shares
from icsd_audit.tokens import Tokens, Weights


def _tokens(seed: int = 0, n_batches: int = 3, zeros: int = 7) -> tuple[Tokens, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    n = 60 * n_batches
    delta = rng.normal(size=n).astype(np.float32)
    delta[rng.choice(n, zeros, replace=False)] = 0.0
    valid = rng.random(n) > 0.1
    tokens = Tokens(advantage=np.zeros(n, np.float32), ratio=np.ones(n, np.float32), delta=delta,
                    traj_id=np.repeat(np.arange(n // 6), 6), turn_id=np.tile(np.repeat([0, 1], 3), n // 6),
                    batch_id=np.repeat(np.arange(n_batches), 60), valid=valid)
    w = {"opsd": np.ones(n), "sdar": rng.random(n), "other": rng.random(n) * 3}
    return tokens, w


def _loop(tokens: Tokens, w: np.ndarray) -> dict[str, float]:
    tot, by = 0.0, {"positive": 0.0, "negative": 0.0, "zero": 0.0}
    for i in range(len(tokens)):
        if not tokens.valid[i]:
            continue
        d = float(tokens.delta[i])
        key = "positive" if d > 0 else "negative" if d < 0 else "zero"
        by[key] += float(w[i])
        tot += float(w[i])
    return {k: v / tot for k, v in by.items()}


def test_shares_equal_a_loop_over_the_valid_tokens() -> None:
    tokens, w = _tokens()
    res = sign_shares(tokens, w, n_resamples=300, rng=1)
    assert res.weightings == ("opsd", "sdar", "other") and res.reference == "opsd"
    counts = {"positive": 0, "negative": 0, "zero": 0}
    for i in range(len(tokens)):
        if tokens.valid[i]:
            d = float(tokens.delta[i])
            counts["positive" if d > 0 else "negative" if d < 0 else "zero"] += 1
    assert (res.n_positive, res.n_negative, res.n_zero) == (counts["positive"], counts["negative"], counts["zero"])
    assert res.n_tokens == int(tokens.valid.sum()) and res.n_batches == 3 and res.n_turns == 2 * len(tokens) // 6
    for name in w:
        want = _loop(tokens, w[name])
        got = res.share(name)
        for s in ("positive", "negative", "zero"):
            assert got.get(s).estimate == pytest.approx(want[s], abs=1e-12), (name, s)
            assert got.get(s).ci_low <= got.get(s).estimate <= got.get(s).ci_high
        assert sum(got.get(s).estimate for s in ("positive", "negative", "zero")) == pytest.approx(1.0, abs=1e-12)
        if name != "opsd":
            ref = _loop(tokens, w["opsd"])
            for s in ("positive", "negative", "zero"):
                assert res.diff(name).get(s).estimate == pytest.approx(want[s] - ref[s], abs=1e-12)
    # the uniform weighting's shares are the token shares, on every resample
    for s in ("positive", "negative", "zero"):
        assert res.share("opsd").get(s) == res.token_share.get(s)


def test_zero_is_left_out_when_no_valid_token_has_delta_zero() -> None:
    tokens, w = _tokens(zeros=0)
    res = sign_shares(tokens, {"opsd": w["opsd"], "sdar": w["sdar"]}, n_resamples=50, rng=0)
    assert res.n_zero == 0 and res.token_share.zero is None and res.diffs[0].zero is None
    d = res.to_dict()
    assert set(d["shares"]["sdar"]) == {"positive", "negative"} and d["tokens"]["zero"] == 0


def test_a_weights_pair_is_base_then_compare_and_identical_weightings_differ_by_exactly_zero() -> None:
    tokens, w = _tokens()
    res = sign_shares(tokens, Weights(w["sdar"], w["sdar"].copy(), base_name="sdar", compare_name="icsd"),
                      n_resamples=200, rng=3)
    assert res.weightings == ("sdar", "icsd")
    for s in ("positive", "negative", "zero"):
        d = res.diff("icsd").get(s)
        assert (d.estimate, d.ci_low, d.ci_high, d.standard_error) == (0.0, 0.0, 0.0, 0.0)


def test_batches_added_one_by_one_or_merged_give_the_bits_of_one_add() -> None:
    tokens, w = _tokens(seed=5)
    whole = sign_shares(tokens, w, n_resamples=400, rng=7)
    parts = []
    for b in range(3):
        sel = np.flatnonzero(tokens.batch_id == b)
        acc = SignSharesAccumulator(names=tuple(w))
        acc.add(Tokens(advantage=tokens.advantage[sel], ratio=tokens.ratio[sel], delta=tokens.delta[sel],
                       traj_id=tokens.traj_id[sel], turn_id=tokens.turn_id[sel], batch_id=tokens.batch_id[sel],
                       valid=tokens.valid[sel]), {k: v[sel] for k, v in w.items()})
        parts.append(acc)
    first = parts[0]
    for p in parts[1:]:
        first.merge(p)
    assert first.finalize(n_resamples=400, rng=7) == whole


def test_the_interval_is_the_same_alone_or_beside_other_families() -> None:
    """SPEC 7: the resamples depend on the seed and the layout, not on what else is bootstrapped."""
    tokens, w = _tokens(seed=2)
    acc = SignSharesAccumulator(names=tuple(w))
    acc.add(tokens, w)
    other = SignSharesAccumulator(names=("a",))
    other.add(tokens, {"a": w["sdar"] ** 2})
    raws = bootstrap_ratio_families([other.family(), acc.family()], n_resamples=300, rng=11)
    assert acc.results(raws[1]) == sign_shares(tokens, w, n_resamples=300, rng=11)


@pytest.mark.parametrize("bad,message", [
    ("nan_delta", "delta: non-finite value nan at row 4"),
    ("negative", "sdar: negative weight -1.0 at row 2"),
])
def test_bad_values_name_the_column_and_row(bad: str, message: str) -> None:
    tokens, w = _tokens()
    tokens.valid[:] = True
    if bad == "nan_delta":
        tokens.delta[4] = np.nan
    else:
        w["sdar"][2] = -1.0
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        sign_shares(tokens, w, n_resamples=10)


def test_labels_must_differ_and_match_the_accumulator() -> None:
    tokens, w = _tokens()
    with pytest.raises(ValueError, match="distinct"):
        SignSharesAccumulator(names=("sdar", "sdar"))
    acc = SignSharesAccumulator(names=("opsd", "sdar"))
    with pytest.raises(ValueError, match=r"labelled \(sdar, opsd\)"):
        acc.add(tokens, {"sdar": w["sdar"], "opsd": w["opsd"]})


def test_a_weighting_with_no_mass_is_undefined_with_the_reason() -> None:
    tokens, w = _tokens()
    res = sign_shares(tokens, {"opsd": w["opsd"], "sdar": np.zeros(len(tokens))}, n_resamples=20, rng=0)
    assert res.undefined == "sdar puts no mass on any valid token"
    assert res.to_dict()["shares"]["sdar"]["positive"]["estimate"] is None


def test_the_token_total_as_its_signs_counts_added_is_the_counts_own_product() -> None:
    """The family's token denominator is the three sign counts' resampled sums added (no product of its own):
    integer counts add exactly, so every value is the bits of the family with the count column multiplied."""
    from dataclasses import replace

    tokens, w = _tokens(seed=5, n_batches=4)
    acc = SignSharesAccumulator(names=tuple(w))
    acc.add(tokens, w)
    fam = acc.family()
    assert list(fam.totals) == [[0, 1, 2]] and list(fam.denominator_index[:3]) == [fam.sums.shape[1]] * 3
    count = np.asarray(fam.sums)[:, :3].sum(axis=1)  # the token count's own column (integers: exact)
    own = replace(fam, sums=np.column_stack([np.asarray(fam.sums), count]), totals=())
    got, want = bootstrap_ratio_families([fam, own], n_resamples=400, rng=3, keep_replicates=True)
    for field in ("estimate", "ci_low", "ci_high", "standard_error", "replicates"):
        assert np.array_equal(getattr(got, field), getattr(want, field), equal_nan=True), field
