"""GiGPO as a verl advantage estimator: turns, rewards, anchors and advantages on padded v1 rows."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")

from icsd_audit.integrations.verl.gigpo import (NEEDS_ICSD_SYNC, Sessions, compute_gigpo_advantage,  # noqa: E402
                                                register_estimator, turn_anchors)
from icsd_audit.train.update.advantages import TurnRecords, gigpo_advantages  # noqa: E402

pytestmark = pytest.mark.engines
torch.set_num_threads(1)


def _h(tokens: list[int]) -> int:
    """The anchor of a token run worked out with hashlib directly: BLAKE2b-64 of the int64 little-endian ids."""
    return int.from_bytes(hashlib.blake2b(np.asarray(tokens, dtype="<i8").tobytes(), digest_size=8).digest(),
                          "little", signed=True)


def _runs(mask_row: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every run of 1s, by a plain scan."""
    out, s = [], None
    for t, v in enumerate(mask_row + [0]):
        if v and s is None:
            s = t
        elif not v and s is not None:
            out.append((s, t))
            s = None
    return out


def reference(rewards: torch.Tensor, mask: torch.Tensor, group: list, traj: list, offset: list, anchor: torch.Tensor,
              **opts) -> torch.Tensor:
    """verl-agent records built turn by turn (a turn's reward: the rewards from its first assistant token up to the
    next turn's; tokens before a row's first turn count for it), GiGPO on them, broadcast to the turns' tokens."""
    B, T = mask.shape
    recs, where = [], []
    for b in range(B):
        runs = _runs(mask[b].tolist())
        for k, (s, e) in enumerate(runs):
            lo = 0 if k == 0 else s
            hi = runs[k + 1][0] if k + 1 < len(runs) else T
            recs.append((group[b], traj[b], offset[b] + k, sum(float(x) for x in rewards[b, lo:hi]), int(anchor[b, s])))
            where.append((b, s, e))
    cols = list(zip(*recs))
    res = gigpo_advantages(TurnRecords.from_arrays(group=cols[0], traj=cols[1], turn=cols[2], reward=cols[3],
                                                   anchor=cols[4]), **opts)
    out = torch.zeros(B, T)
    for i, (b, s, e) in enumerate(where):
        out[b, s:e] = res.advantages[i]
    return out


def test_worked_example():
    # one group, two single-row trajectories of two turns; the outcome sits on a trailing observation token
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 0]])
    rewards = torch.tensor([[0, 0, 0, 0, 0, 1.0], [0, 0, 0, 0, 0, 0.0]])
    kw = dict(index=np.array(["g", "g"], dtype=object), traj_id=torch.tensor([3, 4]), turn_offset=torch.tensor([0, 0]),
              gamma=0.95, step_weight=1.0)
    shared = torch.tensor([[7, 7, 0, 0, 8, 0], [7, 0, 0, 8, 8, 0]])
    adv, ret = compute_gigpo_advantage(rewards, mask, anchor=shared, **kw)
    # episode: scores 1,1,0,0 over the group's turn rows, mean 0.5 -> +-0.5; anchor 7: returns 0.95*1 and 0 -> +-0.475;
    # anchor 8: returns 1 and 0 -> +-0.5 (mean_norm: no std division)
    want = torch.tensor([[0.975, 0.975, 0, 0, 1.0, 0], [-0.975, 0, 0, -1.0, -1.0, 0]])
    assert torch.allclose(adv, want, atol=1e-7) and torch.equal(ret, adv)
    apart = torch.tensor([[7, 7, 0, 0, 8, 0], [7, 0, 0, 9, 9, 0]])  # second turns from different states
    adv2, _ = compute_gigpo_advantage(rewards, mask, anchor=apart, **kw)
    assert torch.allclose(adv2, torch.tensor([[0.975, 0.975, 0, 0, 0.5, 0], [-0.975, 0, 0, -0.5, -0.5, 0]]), atol=1e-7)


def _batch():
    """Two task groups; multi-turn rows with observations between turns; session uA_s1 split over two rows (given
    out of order); a row opening with observation tokens; a padding row; rewards inside spans and at the ends."""
    keys = ["uA_s0_0", "uA_s1_1", "uB_s0_0", "uA_s1_0", "uA_s2_0", "uB_s1_0", "pad_0_0"]
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0],
                         [1, 1, 0, 1, 0, 0, 0, 0, 0],
                         [1, 1, 1, 0, 1, 0, 0, 0, 0],
                         [1, 0, 1, 1, 0, 0, 0, 0, 0],
                         [0, 1, 1, 0, 1, 0, 0, 0, 0],
                         [1, 0, 1, 0, 0, 0, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0, 0, 0]])
    rewards = torch.zeros(mask.shape)
    rewards[0, 3], rewards[0, 8] = 0.3, 1.0  # 0.3 on an observation token: turn 0's span
    rewards[1, 3] = 1.0
    rewards[2, 4] = 0.5
    rewards[3, 3] = 0.2
    rewards[4, 0] = 0.4  # before the row's first turn: counts for it
    anchor = torch.zeros(mask.shape, dtype=torch.long)
    for b, ids in enumerate([[100, 200, 300], [555, 201], [100, 301], [100, 200], [100, 201], [100, 301], []]):
        for (s, e), a in zip(_runs(mask[b].tolist()), ids):
            anchor[b, s:e] = a
    return keys, mask, rewards, anchor


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
def test_estimator_equals_turn_records_built_by_hand(mode):
    keys, mask, rewards, anchor = _batch()
    offset = [0, 2, 0, 0, 0, 0, 0]  # uA_s1_1 continues after the two turns of uA_s1_0
    assert Sessions.from_keys(keys).turn_offsets(mask).tolist() == offset
    assert Sessions.from_keys(keys).final.tolist() == [True, True, True, False, True, True, True]
    group, traj = [0, 0, 1, 0, 0, 1, 2], [0, 1, 0, 1, 2, 1, 0]
    opts = dict(gamma=0.9, step_weight=0.7, mode=mode, epsilon=1e-6)
    want = reference(rewards, mask, group, traj, offset, anchor, **opts)
    metrics: dict = {}
    adv, ret = compute_gigpo_advantage(rewards, mask, index=Sessions.from_keys(keys).uid, config=None,
                                       traj_id=Sessions.from_keys(keys).traj, turn_offset=torch.tensor(offset),
                                       anchor=anchor, metrics=metrics, **opts)
    assert torch.equal(adv, want) and torch.equal(ret, want)
    assert bool((adv[~mask.bool()] == 0).all()) and bool((adv[mask.bool()] != 0).any())
    # 13 turns; uA: 100 x3, 200 x2, 201 x2, 300, 555; uB: 100 x2, 301 x2 (uB's 100 is not uA's): 7 step groups,
    # 11 turns in shared ones
    assert metrics["icsd/gigpo_step_groups"] == 7.0
    assert metrics["icsd/gigpo_step_rows_in_shared_groups"] == pytest.approx(11 / 13)


def test_gamma_defaults_to_verls_algorithm_gamma():
    from verl.trainer.config import AlgoConfig

    keys, mask, rewards, anchor = _batch()
    kw = dict(index=Sessions.from_keys(keys).uid, traj_id=Sessions.from_keys(keys).traj,
              turn_offset=Sessions.from_keys(keys).turn_offsets(mask), anchor=anchor)
    a, _ = compute_gigpo_advantage(rewards, mask, config=AlgoConfig(gamma=0.5), **kw)
    b, _ = compute_gigpo_advantage(rewards, mask, config=AlgoConfig(gamma=0.99), gamma=0.5, **kw)
    c, _ = compute_gigpo_advantage(rewards, mask, config=AlgoConfig(gamma=0.99), **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_anchors_from_token_ids():
    prompts = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 9], [5, 6, 7, 8]])  # row 1's 4th id is padding
    plen = torch.tensor([3, 3, 4])
    responses = torch.tensor([[11, 12, 30, 31, 13, 40, 14],
                              [21, 30, 31, 22, 23, 41, 24],
                              [50, 51, 1, 30, 31, 2, 0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1],
                         [1, 0, 0, 1, 1, 0, 1],
                         [0, 0, 1, 0, 0, 1, 0]])
    got = turn_anchors(prompts, plen, responses, mask)
    p, obs, o40, o41 = _h([5, 6, 7]), _h([30, 31]), _h([40]), _h([41])
    lead = _h([5, 6, 7, 8, 50, 51])  # row 2 opens with observation tokens: they join its prompt
    want = torch.tensor([[p, p, 0, 0, obs, 0, o40],
                         [p, 0, 0, obs, obs, 0, o41],
                         [0, 0, lead, 0, 0, obs, 0]])
    assert torch.equal(got, want)
    assert got[0, 4] == got[1, 3] == got[2, 5] and got[0, 6] != got[1, 6]  # same observation, same state
    # the same rows as verl's jagged storage gives them: padded by TensorDict, lengths from the offsets
    from tensordict import TensorDict

    nt = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    td = TensorDict({"prompts": nt([prompts[i, :plen[i]] for i in range(3)]), "responses": nt(list(responses)),
                     "response_mask": nt(list(mask))}, batch_size=[3])
    pad = td.to_padded_tensor()
    assert torch.equal(turn_anchors(pad["prompts"], td["prompts"].offsets().diff(), pad["responses"],
                                    pad["response_mask"]), want)


def test_without_anchors_plain_verl_gets_one_line():
    from verl.protocol import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from tensordict import TensorDict

    register_estimator()
    _, mask, rewards, _ = _batch()
    with pytest.raises(ValueError) as e:
        compute_gigpo_advantage(rewards, mask, index=np.array(["a"] * 7, dtype=object))
    assert str(e.value) == NEEDS_ICSD_SYNC and "\n" not in NEEDS_ICSD_SYNC
    # verl's own advantage step calls the registered estimator with what it has: the same one line
    data = DataProto(batch=TensorDict({"token_level_rewards": rewards, "response_mask": mask}, batch_size=[7]),
                     non_tensor_batch={"uid": np.array(["a"] * 7, dtype=object)})
    with pytest.raises(ValueError) as e2:
        compute_advantage(data, adv_estimator="gigpo", config=AlgoConfig(adv_estimator="gigpo"))
    assert str(e2.value) == NEEDS_ICSD_SYNC


def test_another_gigpo_in_verl_is_refused(monkeypatch):
    from verl.trainer.ppo import core_algos

    from icsd_audit.integrations.verl.plugin import VerlCompatError

    def compute_gigpo_outcome_advantage(**_):  # e.g. a verl-agent build's own estimator
        return None

    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "gigpo", compute_gigpo_outcome_advantage)
    with pytest.raises(VerlCompatError, match="verl already has an advantage estimator 'gigpo' "
                                              r"\(tests.integrations.test_verl_gigpo.compute_gigpo_outcome_advantage\)"):
        register_estimator()
