"""Allocation inside verl's worker loss, per micro-batch: icsd_ppo_loss(micro=...) and the distillation registry.

The references are built token by token: log-probs read off the flat model output at verl's shifted positions,
trajectories and turns numbered by a loop, and ``allocate`` called on the tokens listed in canonical order.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")

from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from icsd_audit.alloc.variants import allocate  # noqa: E402
from icsd_audit.integrations.checks import BatchInputError  # noqa: E402
from icsd_audit.integrations.core import C_KEY, TEACHER_KEY, stable_traj_id  # noqa: E402
from icsd_audit.integrations.verl.loss import MicroBatchScope, icsd_ppo_loss  # noqa: E402

pytestmark = pytest.mark.engines
torch.set_num_threads(1)
LAM = 0.23


def _configs(**distill):
    from hydra import compose, initialize_config_dir
    import verl
    from verl.utils.config import omega_conf_to_dataclass

    d = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    over = [f"distillation.distillation_loss.{k}={v}" for k, v in distill.items()]
    with initialize_config_dir(config_dir=d, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.n=1", "data.train_batch_size=4", *over])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), omega_conf_to_dataclass(cfg.distillation)


# (uid, session, response mask): session u0/0 spans two rows (its second row continues its turns)
ROWS = [("u0", 0, [1, 1, 1, 0, 0, 1, 1]), ("u0", 1, [1, 1, 1, 1]), ("u1", 0, [1, 1, 0, 1, 1, 1, 1, 1]),
        ("u0", 0, [1, 1, 0, 1]), ("u1", 1, [1, 1, 1, 1, 1, 1])]


def _batch(seed: int, *, teacher_layout: str = "icsd", vocab: int | None = None):
    """A jagged v1 micro-batch and the model output; ``teacher_layout='verl'`` stores the teacher as verl's teacher
    loop does (``teacher_logprobs`` over the whole sequence, last dim 1); ``vocab``: random token ids below it
    (each row's ``ids``, prompt then response) instead of ones."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for uid, s, rm in ROWS:
        R, P = len(rm), int(torch.randint(2, 5, (1,), generator=g))
        rows.append(dict(uid=uid, s=s, P=P, R=R, mask=torch.tensor(rm),
                         old=torch.randn(R, generator=g, dtype=torch.float64) - 2,
                         adv=torch.full((R,), float(torch.randn(1, generator=g)), dtype=torch.float64),
                         teacher=torch.randn(R, generator=g, dtype=torch.float64) - 2))
        rows[-1]["ids"] = (torch.ones(P + R, dtype=torch.long) if vocab is None
                           else torch.randint(3, vocab, (P + R,), generator=g))
    n_tot = sum(r["P"] + r["R"] for r in rows)
    # the current policy: near the old one, so ratios spread around 1
    values = torch.randn(n_tot, generator=g, dtype=torch.float64) - 2
    off = 0
    for r in rows:
        values[off + r["P"] - 1: off + r["P"] - 1 + r["R"]] = r["old"] + 0.2 * torch.randn(r["R"], generator=g,
                                                                                           dtype=torch.float64)
        off += r["P"] + r["R"]
    values.requires_grad_(True)

    def nt(xs):
        return torch.nested.nested_tensor(xs, layout=torch.jagged)

    fields = {"prompts": nt([r["ids"][:r["P"]] for r in rows]), "responses": nt([r["ids"][r["P"]:] for r in rows]),
              "response_mask": nt([r["mask"] for r in rows]), "old_log_probs": nt([r["old"] for r in rows]),
              "advantages": nt([r["adv"] for r in rows])}
    if teacher_layout == "icsd":
        fields[TEACHER_KEY] = nt([r["teacher"] for r in rows])
    else:  # position i of the sequence holds the teacher's log-prob of token i+1, as model log-probs do
        seq = []
        for r in rows:
            t = torch.zeros(r["P"] + r["R"], 1, dtype=torch.float64)
            t[r["P"] - 1: r["P"] - 1 + r["R"], 0] = r["teacher"]
            seq.append(t)
        fields["teacher_logprobs"] = nt(seq)
    td = tu.get_tensordict({**fields, "uid": [r["uid"] for r in rows], "session_id": [r["s"] for r in rows]})
    n_valid = int(sum(r["mask"].sum() for r in rows))
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=n_valid, global_batch_size=None)
    offs = torch.tensor([0] + [r["P"] + r["R"] for r in rows]).cumsum(0)
    out = {"log_probs": torch.nested.nested_tensor_from_jagged(values, offs),
           "entropy": torch.nested.nested_tensor_from_jagged(torch.zeros(n_tot, dtype=torch.float64), offs)}
    return rows, values, td, out, n_valid


def _reference(rows, values, **settings):
    """c of every valid token, by hand: logp at verl's shifted positions, turns numbered by a loop (a session's
    later row continues its turns), tokens listed in (trajectory, turn, position) order, float32-rounded inputs."""
    toks, off, turns_so_far = [], 0, {}
    for b, r in enumerate(rows):
        key = f"{r['uid']}_{r['s']}"
        turn, prev, p = turns_so_far.get(key, 0) - 1, 0, 0
        for j in range(r["R"]):
            if r["mask"][j]:
                if not prev:
                    turn += 1
                logp = float(values[off + r["P"] + j - 1])
                toks.append((stable_traj_id(key), turn, p, b, j, logp))
                p += 1
            prev = int(r["mask"][j])
        turns_so_far[key] = turn + 1
        off += r["P"] + r["R"]
    toks.sort()

    def f32(x):
        return torch.tensor(x, dtype=torch.float32).double()

    logp = [t[5] for t in toks]
    adv = f32([float(rows[t[3]]["adv"][t[4]]) for t in toks])
    ratio = f32([float(np.exp(np.clip(lp - float(rows[t[3]]["old"][t[4]]), -20, 20))) for t, lp in zip(toks, logp)])
    delta = f32([float(np.float32(float(rows[t[3]]["teacher"][t[4]]) - lp)) for t, lp in zip(toks, logp)])
    out = allocate(advantage=adv, ratio=ratio, delta=delta, traj_id=torch.tensor([t[0] for t in toks]),
                   turn_id=torch.tensor([t[1] for t in toks]), **settings)
    return {(t[3], t[4]): (float(out.c[i]), t[5]) for i, t in enumerate(toks)}


def test_micro_batch_scope_allocates_from_the_micro_batchs_own_forward(tmp_path):
    actor_cfg, _ = _configs()
    rows, values, td, out, n = _batch(0)
    scope = MicroBatchScope(min_group=3, dump_dir=str(tmp_path / "dumps"))
    base, _ = ppo_loss(copy.deepcopy(actor_cfg), out, copy.deepcopy(td))
    (g_base,) = torch.autograd.grad(base, values)
    got, metrics = icsd_ppo_loss(copy.deepcopy(actor_cfg), out, td, distill_coef=LAM, micro=scope)
    (g_got,) = torch.autograd.grad(got, values)
    ref = _reference(rows, values.detach(), min_group=3)
    aux, g_aux, off = 0.0, torch.zeros_like(values), 0
    for b, r in enumerate(rows):
        for j in range(r["R"]):
            if r["mask"][j]:
                c, logp = ref[(b, j)]
                aux += c * (float(r["teacher"][j]) - logp)
                g_aux[off + r["P"] + j - 1] = -c / n
        off += r["P"] + r["R"]
    assert float(got.detach()) == pytest.approx(float(base.detach()) + LAM * aux / n, rel=1e-6, abs=1e-9)
    assert torch.allclose(g_got, g_base + LAM * g_aux, rtol=1e-6, atol=1e-9)
    assert "icsd/tcm_icsd" in metrics and "icsd/alloc_seconds" in metrics
    assert C_KEY not in td.keys()  # nothing read from (or needed in) the batch

    # the dump is the micro-batch as allocated; the audit recomputes it exactly
    import pyarrow.parquet as pq

    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.audit.coeffs import compute_coefficients

    shards = sorted((tmp_path / "dumps").glob("*.parquet"))
    assert [p.name for p in shards] == ["part-000000-r00000.parquet"]
    t = pq.read_table(shards[0])
    import json

    from icsd_audit.dumps.provenance import ALLOCATOR_KEYS, PRODUCER_KEYS

    meta = json.loads(t.schema.metadata[b"icsd.dump"])
    alloc, prod = meta["allocator"], meta["producer"]
    assert set(ALLOCATOR_KEYS) <= set(alloc) and set(PRODUCER_KEYS) <= set(prod)  # SPEC 9: every key present
    assert (alloc["allocator"], alloc["trust"], alloc["min_group"], alloc["alloc_scope"], alloc["ratio_source"]) == (
        "icsd", "laplace", 3, "micro-batch", "own-forward")
    assert (prod["engine"], prod["rank"], prod["world_size"]) == ("verl", 0, 1)
    from icsd_audit.audit.verify import verify_dumps

    assert verify_dumps(shards).ok  # `icsd audit verify`: the shard's own provenance reproduces its g, m, c
    assert t.num_rows == n
    compute_coefficients(shards, tmp_path / "c.parquet", AllocatorOptions(min_group=3))
    rec = pq.read_table(tmp_path / "c.parquet").column("c").to_numpy().astype(np.float32)
    assert np.array_equal(rec, t.column("c").to_numpy())
    want = sorted(np.float32(c) for c, _ in ref.values())
    assert np.array_equal(np.sort(t.column("c").to_numpy()), np.asarray(want, dtype=np.float32))


def test_micro_batch_scope_follows_the_current_ratio():
    """Two forwards of the same micro-batch with different weights give different c (the ratio moved), each
    equal to its own by-hand allocation: no stale ratio-1 allocation."""
    actor_cfg, _ = _configs()
    rows, values, td, out, n = _batch(1)
    scope = MicroBatchScope(min_group=3)
    cs = []
    for shift in (0.0, 0.4):
        v = (values.detach() + shift * torch.linspace(-1, 1, values.numel(), dtype=torch.float64)).requires_grad_(True)
        offs = out["log_probs"].offsets()
        o = {"log_probs": torch.nested.nested_tensor_from_jagged(v, offs), "entropy": out["entropy"]}
        m = scope.allocate(log_prob=_padded_logp(o, td), teacher=td.select(TEACHER_KEY).to_padded_tensor()[TEACHER_KEY],
                           data=td, teacher_key=TEACHER_KEY)
        ref = _reference(rows, v.detach(), min_group=3)
        for (b, j), (c, _) in ref.items():
            assert float(m.alloc.c[b, j]) == pytest.approx(c, rel=1e-12, abs=1e-15)
        cs.append(m.alloc.c)
    assert not torch.allclose(cs[0], cs[1])
    del actor_cfg, n


def _padded_logp(out, td):
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(out["log_probs"], td)


def test_micro_batch_scope_refuses_non_finite_inputs_naming_the_session():
    actor_cfg, _ = _configs()
    for key in ("advantages", "old_log_probs", TEACHER_KEY):
        rows, values, td, out, n = _batch(2)
        vals = [x.clone() for x in td[key].unbind()]
        vals[2][3] = float("nan") if key != TEACHER_KEY else float("-inf")
        td[key] = torch.nested.nested_tensor(vals, layout=torch.jagged)
        with pytest.raises(BatchInputError) as e:
            icsd_ppo_loss(copy.deepcopy(actor_cfg), out, td, distill_coef=LAM, micro=MicroBatchScope(min_group=3))
        msg = str(e.value)
        assert msg.startswith(f"{key} is ") and "at row 2 (uid_session 'u1_0'), response token 2" in msg, msg


@pytest.mark.parametrize("policy_gradient", [False, True])
@pytest.mark.parametrize("mode,allocator", [("icsd", "icsd"), ("sdar", "sdar"), ("icsd_gaussian", "gaussian")])
def test_distillation_registry_losses_are_c_times_k1(monkeypatch, tmp_path, mode, allocator, policy_gradient):
    """Through verl's own get_distillation_loss_fn: per-token c * k1 (policy-gradient mode: verl's advantage is
    then c * (T - logp)) or -c * k1 = c * (sg(T) - logp) (supervised mode), with c allocated over the micro-batch
    from its current log-probs; and verl's distillation_loss aggregates it into the paper's term."""
    from verl.trainer.distillation.losses import distillation_loss, get_distillation_loss_fn

    monkeypatch.setenv("ICSD_MIN_GROUP", "3")
    monkeypatch.setenv("ICSD_DUMP_DIR", str(tmp_path / mode))
    actor_cfg, dist_cfg = _configs(loss_mode=mode, use_policy_gradient=str(policy_gradient).lower())
    rows, values, td, out, n = _batch(3, teacher_layout="verl")
    losses, metrics = get_distillation_loss_fn(mode)(config=copy.deepcopy(actor_cfg), distillation_config=dist_cfg,
                                                     model_output=out, data=td)
    ref = _reference(rows, values.detach(), min_group=3, allocator=allocator)
    want = torch.zeros(len(rows), max(r["R"] for r in rows), dtype=torch.float64)
    for (b, j), (c, logp) in ref.items():
        k1 = logp - float(rows[b]["teacher"][j])
        want[b, j] = c * k1 if policy_gradient else -c * k1
    mask = td["response_mask"].to_padded_tensor(0).bool()
    assert torch.allclose(losses.detach()[mask], want[mask], rtol=1e-6, atol=1e-12)
    assert "icsd/tcm_icsd" in metrics and "icsd/c_mean" in metrics
    assert len(list((tmp_path / mode).glob("*.parquet"))) == 1
    if not policy_gradient:  # verl aggregates: token-mean over the mini-batch's global token count
        agg, _ = distillation_loss(copy.deepcopy(actor_cfg), dist_cfg, out, td)
        (g,) = torch.autograd.grad(agg, values)
        paper = sum(c * (float(rows[b]["teacher"][j]) - logp) for (b, j), (c, logp) in ref.items()) / n
        assert float(agg.detach()) == pytest.approx(paper, rel=1e-6)
        assert float(g.abs().sum()) == pytest.approx(sum(c for c, _ in ref.values()) / n, rel=1e-6)


def test_distillation_registry_knows_the_names_and_refuses_top_k_teachers(monkeypatch):
    from verl.trainer.distillation.losses import DISTILLATION_LOSS_REGISTRY, get_distillation_loss_settings

    from icsd_audit.integrations.verl.distill import LOSS_ALLOCATORS, icsd_distillation_loss

    for name in LOSS_ALLOCATORS:
        assert DISTILLATION_LOSS_REGISTRY[name] is icsd_distillation_loss
        assert get_distillation_loss_settings(name).use_estimator
    actor_cfg, dist_cfg = _configs(loss_mode="icsd")
    rows, values, td, out, n = _batch(4, teacher_layout="verl")
    t = [torch.cat([x, x], -1) for x in td["teacher_logprobs"].unbind()]
    td["teacher_logprobs"] = torch.nested.nested_tensor(t, layout=torch.jagged)
    with pytest.raises(ValueError, match="holds 2 per position"):
        icsd_distillation_loss(copy.deepcopy(actor_cfg), dist_cfg, out, td)
    monkeypatch.setenv("ICSD_MIN_GROUP", "eight")
    _, _, td, out, _ = _batch(4, teacher_layout="verl")
    with pytest.raises(ValueError, match="ICSD_MIN_GROUP='eight' is not a valid int"):
        icsd_distillation_loss(copy.deepcopy(actor_cfg), dist_cfg, out, td)


def test_registry_losses_take_every_setting_from_the_environment(monkeypatch):
    """ICSD_TRUST_ETA and ICSD_INFLUENCE_ETA reach the allocation as the other ICSD_* settings do."""
    from verl.trainer.distillation.losses import get_distillation_loss_fn

    env = {"ICSD_MIN_GROUP": "3", "ICSD_TRUST_ETA": "0.3", "ICSD_INFLUENCE_ETA": "0.6", "ICSD_EPS": "0.001"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    actor_cfg, dist_cfg = _configs(loss_mode="icsd", use_policy_gradient="true")
    rows, values, td, out, _ = _batch(6, teacher_layout="verl")
    losses, _ = get_distillation_loss_fn("icsd")(config=copy.deepcopy(actor_cfg), distillation_config=dist_cfg,
                                                 model_output=out, data=td)
    ref = _reference(rows, values.detach(), min_group=3, trust_eta=0.3, influence_eta=0.6, eps=0.001)
    default = _reference(rows, values.detach(), min_group=3, eps=0.001)
    got = {k: float(losses.detach()[k[0], k[1]]) for k in ref}
    want = {k: c * (logp - float(rows[k[0]]["teacher"][k[1]])) for k, (c, logp) in ref.items()}
    assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert any(abs(ref[k][0] - default[k][0]) > 1e-6 for k in ref)  # the etas changed c: the test can fail


def test_registry_losses_refuse_the_legacy_trainers_rows_naming_trainer_use_v1():
    """verl's legacy trainer (trainer.use_v1=false) hands the loss rows without session_id: one line, not
    'the micro-batch names no trajectories'."""
    from icsd_audit.integrations.verl.distill import icsd_distillation_loss

    actor_cfg, dist_cfg = _configs(loss_mode="sdar")
    _, _, td, out, _ = _batch(7, teacher_layout="verl")
    del td["session_id"]
    with pytest.raises(ValueError) as e:
        icsd_distillation_loss(copy.deepcopy(actor_cfg), dist_cfg, out, td)
    assert str(e.value) == ("distillation loss_mode=sdar needs verl's v1 trainer (trainer.use_v1=true): the legacy "
                            "trainer's micro-batches carry no session_id, so no row names its trajectory")
