"""GRPO / GiGPO advantages: hand-worked examples, a slow loop reference, invariances."""

from __future__ import annotations

import math
import random
from collections import defaultdict

import numpy as np
import pytest
import torch

from icsd_audit.train.update.advantages import (
    ESTIMATORS,
    TurnRecords,
    anchor_id,
    anchor_ids,
    broadcast_to_tokens,
    get_estimator,
    gigpo_advantages,
    grpo_advantages,
)

EPS = 1e-6


def approx(x, rel=1e-6, abs=1e-7):
    return pytest.approx(x, rel=rel, abs=abs)


# ---------------------------------------------------------------------------------------
# Hand-worked example A (GRPO): one task group, three rollouts of lengths 2, 1, 3.
#   traj 0: rewards (0, 1)       -> R0 = 1
#   traj 1: rewards (0)          -> R1 = 0
#   traj 2: rewards (0, 0, 0.5)  -> R2 = 0.5
# Row scores (every row carries its episode return): [1, 1, 0, .5, .5, .5].
# ---------------------------------------------------------------------------------------

A = dict(
    group=[0, 0, 0, 0, 0, 0],
    traj=[0, 0, 1, 2, 2, 2],
    turn=[0, 1, 0, 0, 1, 2],
    reward=[0.0, 1.0, 0.0, 0.0, 0.0, 0.5],
)


def test_grpo_hand_worked_stats_over_steps():
    # verl-agent default: statistics over the 6 rows.
    # mean = (1+1+0+.5+.5+.5)/6 = 3.5/6 = 7/12
    # deviations: 5/12 (x2), -7/12, -1/12 (x3)
    # SS = 2*25/144 + 49/144 + 3*1/144 = 102/144 = 17/24 ; unbiased var = (17/24)/5 = 17/120
    std = math.sqrt(17 / 120)  # 0.376386...
    res = grpo_advantages(TurnRecords.from_arrays(**A))
    want = [5 / 12 / (std + EPS)] * 2 + [-7 / 12 / (std + EPS)] + [-1 / 12 / (std + EPS)] * 3
    assert res.advantages.tolist() == approx(want)
    assert res.advantages.dtype == torch.float32
    assert res.scores.tolist() == [1, 1, 0, 0.5, 0.5, 0.5]
    assert res.advantages[0].item() == approx(1.107019, rel=1e-5)


def test_grpo_hand_worked_mean_only():
    # norm_adv_by_std_in_grpo=False (Dr. GRPO): just score - 7/12
    res = grpo_advantages(TurnRecords.from_arrays(**A), norm_adv_by_std_in_grpo=False)
    assert res.advantages.tolist() == approx([5 / 12, 5 / 12, -7 / 12, -1 / 12, -1 / 12, -1 / 12])


def test_grpo_hand_worked_stats_over_trajectories():
    # one entry per trajectory: [1, 0, .5] -> mean .5, deviations .5, -.5, 0
    # unbiased var = (.25 + .25 + 0)/2 = .25 -> std .5
    res = grpo_advantages(TurnRecords.from_arrays(**A), stats_over="trajectories")
    a = 0.5 / (0.5 + EPS)
    assert res.advantages.tolist() == approx([a, a, -a, 0, 0, 0])


def test_grpo_singleton_group_keeps_raw_score():
    # A group with a single entry uses mean 0, std 1 (verl): advantage = score / (1 + eps).
    rec = TurnRecords.from_arrays(group=[7], traj=[0], turn=[0], reward=[0.7])
    assert grpo_advantages(rec).advantages.tolist() == approx([0.7 / (1 + EPS)])
    assert grpo_advantages(rec, norm_adv_by_std_in_grpo=False).advantages.tolist() == approx([0.7])


def test_grpo_equal_scores_give_zero():
    # std = 0 -> (x - mean) / (0 + eps) = 0 / eps = 0
    rec = TurnRecords.from_arrays(group=[0, 0, 0], traj=[0, 1, 2], turn=[0, 0, 0], reward=[1.0, 1.0, 1.0])
    assert grpo_advantages(rec).advantages.tolist() == [0.0, 0.0, 0.0]


def test_grpo_invalid_penalty_is_per_row():
    # verl-agent subtracts coef * invalid from each invalid row's score (not the whole episode).
    # Example A with traj 0's first turn invalid, coef 0.1: scores [.9, 1, 0, .5, .5, .5]
    rec = TurnRecords.from_arrays(**A, invalid=[True, False, False, False, False, False])
    res = grpo_advantages(rec, invalid_penalty=0.1, norm_adv_by_std_in_grpo=False)
    mean = (0.9 + 1 + 0 + 1.5) / 6  # 3.4/6
    assert res.scores.tolist() == approx([0.9, 1, 0, 0.5, 0.5, 0.5])
    assert res.advantages.tolist() == approx([0.9 - mean, 1 - mean, -mean, 0.5 - mean, 0.5 - mean, 0.5 - mean])


def test_grpo_groups_are_independent():
    # Two copies of example A in groups 0 and 1 with group 1's rewards doubled:
    # group 1's normalised advantages equal group 0's (scale invariance of mean-std).
    two = {k: v + v for k, v in A.items()}
    two["group"] = [0] * 6 + [1] * 6
    two["reward"] = A["reward"] + [2 * r for r in A["reward"]]
    res = grpo_advantages(TurnRecords.from_arrays(**two))
    assert res.advantages[:6].tolist() == approx(res.advantages[6:].tolist(), rel=1e-5)


# ---------------------------------------------------------------------------------------
# Hand-worked example B (GiGPO), a WebShop-like group of two rollouts.
#   traj 0: obs A -> r 0 ; obs B -> r 0 ; obs C -> r 1   (bought the right item)
#   traj 1: obs A -> r 0 ; obs D -> r .2                  (bought a wrong item)
# Episode returns R0 = 1, R1 = .2 ; row scores [1, 1, 1, .2, .2]
# Discounted returns (gamma .95): traj 0: G2 = 1, G1 = .95, G0 = .9025 ; traj 1: G1 = .2, G0 = .19
# Anchor groups: A = {row0: .9025, row3: .19}; B, C, D singletons.
# ---------------------------------------------------------------------------------------

B = dict(
    group=[0, 0, 0, 0, 0],
    traj=[0, 0, 0, 1, 1],
    turn=[0, 1, 2, 0, 1],
    reward=[0.0, 0.0, 1.0, 0.0, 0.2],
    anchor=[anchor_id(s) for s in ["A", "B", "C", "A", "D"]],
)


def test_gigpo_hand_worked_mean_norm():
    res = gigpo_advantages(TurnRecords.from_arrays(**B))
    # episode (mean_norm: no std): mean over rows = 3.4/5 = .68 -> [.32, .32, .32, -.48, -.48]
    assert res.episode_advantages.tolist() == approx([0.32, 0.32, 0.32, -0.48, -0.48])
    assert res.step_returns.tolist() == approx([0.9025, 0.95, 1.0, 0.19, 0.2])
    # step group A: mean (.9025 + .19)/2 = .54625 -> +-.35625 ; singletons -> 0
    assert res.step_advantages.tolist() == approx([0.35625, 0.0, 0.0, -0.35625, 0.0])
    # total = episode + 1.0 * step
    assert res.advantages.tolist() == approx([0.67625, 0.32, 0.32, -0.83625, -0.48])
    assert res.step_group_size.tolist() == [2, 1, 1, 2, 1]


def test_gigpo_hand_worked_mean_std_norm():
    res = gigpo_advantages(TurnRecords.from_arrays(**B), mode="mean_std_norm")
    # episode: deviations .32 (x3), -.48 (x2); SS = 3*.1024 + 2*.2304 = .768; var = .768/4 = .192
    s_ep = math.sqrt(0.192)  # .438178
    assert res.episode_advantages.tolist() == approx([0.32 / (s_ep + EPS)] * 3 + [-0.48 / (s_ep + EPS)] * 2)
    # step A: deviations +-.35625, var = 2*.35625**2/1 -> std = .35625*sqrt(2)
    s_st = 0.35625 * math.sqrt(2)
    a = 0.35625 / (s_st + EPS)  # ~ 1/sqrt(2)
    assert a == approx(1 / math.sqrt(2), rel=1e-5)
    assert res.step_advantages.tolist() == approx([a, 0, 0, -a, 0])


def test_gigpo_step_weight_and_gamma():
    res = gigpo_advantages(TurnRecords.from_arrays(**B), step_weight=0.5, gamma=1.0)
    # gamma 1: returns = [1, 1, 1, .2, .2]; group A: (1, .2) mean .6 -> +-.4 ; weight .5 -> +-.2
    assert res.step_returns.tolist() == approx([1, 1, 1, 0.2, 0.2])
    assert res.advantages.tolist() == approx([0.32 + 0.2, 0.32, 0.32, -0.48 - 0.2, -0.48])


def test_gigpo_revisited_state_in_one_trajectory_joins_the_group():
    # traj 0 goes A -> B -> A(again) -> C(r=1); traj 1: A -> D(r=0)
    # returns traj 0: G3 = 1, G2 = .95, G1 = .9025, G0 = .857375 ; traj 1: 0, 0
    # group A = {.857375, .95, 0}: mean = 1.807375/3 = .602458333...
    rec = TurnRecords.from_arrays(
        group=[0] * 6,
        traj=[0, 0, 0, 0, 1, 1],
        turn=[0, 1, 2, 3, 0, 1],
        reward=[0, 0, 0, 1, 0, 0],
        anchor=anchor_ids(["A", "B", "A", "C", "A", "D"]),
    )
    res = gigpo_advantages(rec)
    m = (0.857375 + 0.95 + 0) / 3
    assert res.step_advantages.tolist() == approx([0.857375 - m, 0, 0.95 - m, 0, -m, 0])
    assert res.step_group_size.tolist() == [3, 1, 3, 1, 3, 1]


def test_gigpo_anchor_groups_do_not_cross_task_groups():
    # same observation text in two task groups: never one step group
    rec = TurnRecords.from_arrays(
        group=[0, 1], traj=[0, 0], turn=[0, 0], reward=[1.0, 0.0], anchor=anchor_ids(["same", "same"])
    )
    res = gigpo_advantages(rec)
    assert res.step_group_size.tolist() == [1, 1]
    assert res.step_advantages.tolist() == [0.0, 0.0]
    # and each lone episode group keeps its raw score (mean 0): [1, 0]
    assert res.episode_advantages.tolist() == [1.0, 0.0]


def test_gigpo_invalid_penalty_hits_step_returns_too():
    # verl-agent subtracts coef*invalid from the row's score and from its step return.
    rec = TurnRecords.from_arrays(**B, invalid=[False, True, False, False, False])
    res = gigpo_advantages(rec, invalid_penalty=0.1)
    assert res.scores.tolist() == approx([1, 0.9, 1, 0.2, 0.2])
    # the discount runs on the raw rewards; the penalty only shifts the penalised row
    assert res.step_returns.tolist() == approx([0.9025, 0.85, 1.0, 0.19, 0.2])


def test_gigpo_needs_anchor_and_valid_mode():
    rec = TurnRecords.from_arrays(**A)
    with pytest.raises(ValueError, match="anchor"):
        gigpo_advantages(rec)
    with pytest.raises(ValueError, match="mode"):
        gigpo_advantages(TurnRecords.from_arrays(**B), mode="std")


def test_validation_messages():
    with pytest.raises(ValueError, match=r"rows 1 and 2 share \(group, traj, turn\) = \(0, 0, 1\)"):
        TurnRecords.from_arrays(group=[0, 0, 0], traj=[0, 0, 0], turn=[0, 1, 1], reward=[0, 0, 0])
    with pytest.raises(ValueError, match="column traj has 1 rows"):
        TurnRecords.from_arrays(group=[0, 0], traj=[0], turn=[0, 1], reward=[0, 0])
    with pytest.raises(ValueError, match="reward row 1 is nan"):
        TurnRecords.from_arrays(group=[0, 0], traj=[0, 0], turn=[0, 1], reward=[0.0, float("nan")])
    with pytest.raises(ValueError, match="column turn row 0 is 0.5"):
        TurnRecords.from_arrays(group=[0], traj=[0], turn=[0.5], reward=[0.0])
    with pytest.raises(ValueError, match="stats_over"):
        grpo_advantages(TurnRecords.from_arrays(**A), stats_over="tokens")
    with pytest.raises(ValueError, match="gamma"):
        gigpo_advantages(TurnRecords.from_arrays(**B), gamma=1.5)


def test_empty_batch():
    rec = TurnRecords.from_arrays(group=[], traj=[], turn=[], reward=[], anchor=[])
    assert grpo_advantages(rec).advantages.numel() == 0
    assert gigpo_advantages(rec).advantages.numel() == 0


def test_registry_and_mapping_input():
    assert set(ESTIMATORS) == {"grpo", "gigpo"}
    assert get_estimator("GiGPO") is gigpo_advantages
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        get_estimator("ppo")
    res = get_estimator("grpo")(A)  # a plain mapping works too
    assert res.estimator == "grpo"


def test_anchor_id_is_stable_and_text_exact():
    assert anchor_id("Search") == anchor_id("Search")
    assert anchor_id("Search") != anchor_id("search")
    # fixed value: the id must not depend on the process (PYTHONHASHSEED) or machine
    assert anchor_id("Search") == 2760617390197573594
    assert anchor_id("") == -5426141060434712860


def test_broadcast_to_tokens():
    adv = torch.tensor([0.5, -1.0])
    token_turn = torch.tensor([0, 0, 0, 1, 1])
    assert broadcast_to_tokens(adv, token_turn).tolist() == [0.5, 0.5, 0.5, -1.0, -1.0]


def test_metrics_keys():
    m = gigpo_advantages(TurnRecords.from_arrays(**B)).metrics()
    assert m["adv/step_groups"] == 4.0
    assert m["adv/step_rows_in_shared_groups"] == approx(2 / 5)


# ---------------------------------------------------------------------------------------
# Slow loop reference: a direct, dictionary-based restatement of verl-agent's semantics
# (episode_norm_reward / compute_grpo_outcome_advantage, build_step_group,
# step_norm_reward, compute_step_discounted_returns), rows visited in batch order.
# ---------------------------------------------------------------------------------------


def _unbiased_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_advantages(rows, *, estimator, norm_std, eps, stats_over, coef, gamma=0.95, w=1.0):
    """rows: list of dicts(group, traj, turn, reward, anchor, invalid) in batch order."""
    by_traj = defaultdict(list)
    for i, r in enumerate(rows):
        by_traj[(r["group"], r["traj"])].append(i)
    ep_return = {k: sum(rows[i]["reward"] for i in idx) for k, idx in by_traj.items()}
    scores = [ep_return[(r["group"], r["traj"])] - coef * r["invalid"] for r in rows]

    # episode level
    id2score = defaultdict(list)
    seen = set()
    for i, r in enumerate(rows):
        key = (r["group"], r["traj"])
        if key in seen:
            continue
        id2score[r["group"]].append(scores[i])
        if stats_over == "trajectories":
            seen.add(key)
    mean, std = {}, {}
    for g, xs in id2score.items():
        if len(xs) == 1:
            mean[g], std[g] = 0.0, 1.0
        else:
            mean[g], std[g] = sum(xs) / len(xs), _unbiased_std(xs)
    ep = []
    for i, r in enumerate(rows):
        g = r["group"]
        ep.append((scores[i] - mean[g]) / (std[g] + eps) if norm_std else scores[i] - mean[g])
    if estimator == "grpo":
        return ep

    # discounted returns, walking each trajectory backwards in turn order
    ret = [0.0] * len(rows)
    for idx in by_traj.values():
        idx = sorted(idx, key=lambda i: rows[i]["turn"])
        running = 0.0
        for i in reversed(idx):
            running = rows[i]["reward"] + gamma * running
            ret[i] = running
    ret = [ret[i] - coef * r["invalid"] for i, r in enumerate(rows)]

    # step groups: identical anchors inside one task group
    clusters = defaultdict(list)
    for i, r in enumerate(rows):
        clusters[(r["group"], r["anchor"])].append(i)
    step = [0.0] * len(rows)
    for idx in clusters.values():
        xs = [ret[i] for i in idx]
        if len(xs) == 1:
            m, s = xs[0], 1.0
        else:
            m, s = sum(xs) / len(xs), _unbiased_std(xs)
        for i in idx:
            step[i] = (ret[i] - m) / (s + eps) if norm_std else ret[i] - m
    return [e + w * s for e, s in zip(ep, step, strict=True)]


def random_rows(rng: random.Random, n_groups: int, g_size: int, max_turns: int, n_obs: int):
    rows = []
    for g in range(n_groups):
        for t in range(g_size):
            length = rng.randint(1, max_turns)
            for k in range(length):
                final = k == length - 1
                rows.append(
                    dict(
                        group=g * 3 + 1,  # non-contiguous ids on purpose
                        traj=t * 7,
                        turn=k,
                        reward=round(rng.random(), 2) if (final or rng.random() < 0.2) else 0.0,
                        anchor=anchor_id(f"obs{rng.randrange(n_obs)}"),
                        invalid=rng.random() < 0.2,
                    )
                )
    return rows


def to_records(rows):
    return TurnRecords.from_arrays(**{k: [r[k] for r in rows] for k in rows[0]})


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stats_over", ["steps", "trajectories"])
def test_matches_loop_reference(seed, stats_over):
    rng = random.Random(seed)
    rows = random_rows(rng, n_groups=rng.randint(1, 5), g_size=rng.randint(1, 6), max_turns=6, n_obs=4)
    rec = to_records(rows)
    coef = 0.1 if seed % 2 else 0.0
    for norm_std in (True, False):
        got = grpo_advantages(rec, norm_adv_by_std_in_grpo=norm_std, stats_over=stats_over, invalid_penalty=coef)
        want = ref_advantages(rows, estimator="grpo", norm_std=norm_std, eps=EPS, stats_over=stats_over, coef=coef)
        np.testing.assert_allclose(got.advantages.numpy(), np.array(want), rtol=1e-5, atol=1e-5)
    for mode, norm_std in (("mean_norm", False), ("mean_std_norm", True)):
        for gamma, w in ((0.95, 1.0), (0.5, 0.3)):
            got = gigpo_advantages(
                rec, mode=mode, gamma=gamma, step_weight=w, stats_over=stats_over, invalid_penalty=coef
            )
            want = ref_advantages(
                rows, estimator="gigpo", norm_std=norm_std, eps=EPS, stats_over=stats_over, coef=coef, gamma=gamma, w=w
            )
            np.testing.assert_allclose(got.advantages.numpy(), np.array(want), rtol=1e-5, atol=1e-5)


def test_row_order_does_not_matter():
    rng = random.Random(11)
    rows = random_rows(rng, n_groups=4, g_size=5, max_turns=7, n_obs=3)
    perm = list(range(len(rows)))
    rng.shuffle(perm)
    shuffled = [rows[i] for i in perm]
    for fn in (grpo_advantages, gigpo_advantages):
        a = fn(to_records(rows), invalid_penalty=0.1).advantages
        b = fn(to_records(shuffled), invalid_penalty=0.1).advantages
        np.testing.assert_allclose(b.numpy(), a[perm].numpy(), rtol=1e-6, atol=1e-7)


def test_numpy_and_tensor_inputs_agree():
    rng = random.Random(3)
    rows = random_rows(rng, n_groups=3, g_size=4, max_turns=5, n_obs=3)
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    as_np = TurnRecords.from_arrays(**{k: np.asarray(v) for k, v in cols.items()})
    # (a float list becomes float32 in torch.tensor; give the rewards as float64 to compare bit-exactly)
    as_t = TurnRecords.from_arrays(
        **{k: torch.tensor(v, dtype=torch.float64 if k == "reward" else None) for k, v in cols.items()}
    )
    assert torch.equal(gigpo_advantages(as_np).advantages, gigpo_advantages(as_t).advantages)


def test_tied_group_gives_exact_zero_advantage() -> None:
    """0.1 three times: sum/3 rounds to 0.10000000000000002, yet the advantage must be 0."""
    import torch as _t

    from icsd_audit.train.update.advantages import group_normalize

    v = _t.tensor([0.1, 0.1, 0.1, 1.0, 2.0], dtype=_t.float64)
    ids = _t.tensor([0, 0, 0, 1, 1])
    assert (v[:3].sum() / 3).item() != 0.1  # the rounding the rule exists for
    out = group_normalize(v, ids, 2, norm_by_std=False, epsilon=1e-6, singleton="zero_mean")
    assert out[:3].tolist() == [0.0, 0.0, 0.0]
    assert out[3:].tolist() == [-0.5, 0.5]
