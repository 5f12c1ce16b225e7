"""icsd_sync's driver step on real verl config, TensorDict and KVBatchMeta objects.

TransferQueue and the Ray worker group need a cluster, so they are replaced by an
in-memory key-value store and a worker group that scores rows with the tiny model in
verl's layout (log-prob of token i+1 at position i over the whole sequence).  What runs
for real: our trainer methods, verl's padding helpers, the allocation and the dumps.
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
tq = pytest.importorskip("transfer_queue", reason="TransferQueue not installed: pip install 'icsd-audit[verl]'")

from tensordict import TensorDict  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402

from icsd_audit.integrations.verl import plugin as iv  # noqa: E402
from icsd_audit.integrations.core import allocate_padded, turn_ids_from_mask  # noqa: E402
from icsd_audit.integrations.verl.trainer import (ICSDVerlConfig, register, trajectory_turns,  # noqa: E402
                                                  v1_mini_batch_ids)
from icsd_audit.train.models.loading import tiny_random_causal_lm  # noqa: E402
from icsd_audit.train.rollout.prompts import skill_block  # noqa: E402
from icsd_audit.train.teacher.skills import load_skillbank  # noqa: E402

pytestmark = pytest.mark.engines
torch.set_num_threads(1)


def test_v1_mini_batch_ids_by_hand():
    # 8 rows, 2 ranks (rows 0-3, 4-7), global mini-batch of 4 = 2 rows per rank
    assert v1_mini_batch_ids(8, mini_batch_size=4, dp_size=2).tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert v1_mini_batch_ids(6, mini_batch_size=3, dp_size=1).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError):
        v1_mini_batch_ids(6, mini_batch_size=4, dp_size=2)


def test_trajectory_turns_number_runs_across_a_sessions_rows():
    m = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 1, 1, 0, 1], [1, 1, 1, 0, 0]]).bool()
    keys = ["u1_s0_1", "u2_s0_0", "u1_s0_0", "u1_s1_0"]  # row 2 is u1_s0's first output
    traj, turn = trajectory_turns(keys, m)
    assert traj[0] == traj[2] and len({int(traj[1]), int(traj[0]), int(traj[3])}) == 3
    assert turn[2].tolist() == [-1, 0, 0, -1, 1]
    assert turn[0].tolist() == [2, 2, -1, 3, -1]  # continues after the two turns of row 2
    assert turn[1].tolist() == [0, -1, -1, -1, -1]
    assert turn[3].tolist() == [0, 0, 0, -1, -1]


class _Store:
    """In-memory stand-in for TransferQueue's kv API (same call signatures)."""

    def __init__(self):
        self.rows: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None, data_parser=None):
        for i, k in enumerate(keys):
            row = self.rows.setdefault((partition_id, k), {})
            if fields is not None:
                for name in fields.keys():
                    v = fields[name]
                    row[name] = v.unbind()[i] if v.is_nested else v[i]
        return KVBatchMeta(keys=list(keys), tags=list(tags or [{} for _ in keys]), partition_id=partition_id)

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        out = {}
        for name in select_fields:
            if not any(name in self.rows[(partition_id, k)] for k in keys):
                continue  # TransferQueue's select_fields leaves out a field no row has (verl relies on it)
            xs = [self.rows[(partition_id, k)][name] for k in keys]
            out[name] = torch.nested.as_nested_tensor(xs, layout=torch.jagged)
        return TensorDict(out, batch_size=[len(keys)])

    def kv_clear(self, keys, partition_id):
        for k in keys:
            del self.rows[(partition_id, k)]


class _WorkerGroup:
    world_size = 2

    def __init__(self, store, model):
        self.store, self.model, self.loss_fn = store, model, None

    def set_loss_fn(self, loss_fn):
        self.loss_fn = loss_fn

    def compute_log_prob(self, meta):
        assert meta.extra_info["compute_loss"] is False
        for k in meta.keys:
            row = self.store.rows[(meta.partition_id, k)]
            ids = row["input_ids"]
            assert torch.equal(row["position_ids"], torch.arange(ids.numel()))
            with torch.no_grad():
                logits = self.model(input_ids=ids.view(1, -1)).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:].view(-1, 1)).view(-1)
            row["log_probs"] = torch.cat([lp, torch.zeros(1)])  # position i: log p(token i+1)


def _trainer(tmp_path, monkeypatch, extra=()):
    from hydra import compose, initialize_config_dir
    import verl

    d = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    with initialize_config_dir(config_dir=d, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "data.train_batch_size=4", "+icsd.min_group=2", "+icsd.distill_coef=0.05",
            f"+icsd.dump_dir={tmp_path / 'dumps'}", *extra])
    store = _Store()
    for name in ("kv_batch_put", "kv_batch_get", "kv_clear"):
        monkeypatch.setattr(tq, name, getattr(store, name))
    monkeypatch.setattr(PPOTrainerSync, "on_init_end", lambda self: None)
    monkeypatch.setattr(PPOTrainerSync, "_compute_advantage", lambda self, batch, metrics: batch)
    model, tok = tiny_random_causal_lm(seed=1)
    cls = register()
    tr = cls.__new__(cls)  # the Ray resource set-up of __init__ is out of reach on CPU
    tr.config, tr.tokenizer, tr.global_steps = cfg, tok, 7
    tr.actor_rollout_wg = _WorkerGroup(store, model)
    return tr, store, model, tok


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    return _trainer(tmp_path, monkeypatch)


def test_icsd_sync_driver_step(setup, tmp_path):
    tr, store, model, tok = setup
    tr.on_init_end()
    fn = tr.actor_rollout_wg.loss_fn
    assert isinstance(fn, partial) and fn.func is iv.icsd_ppo_loss and fn.keywords["distill_coef"] == 0.05

    g = torch.Generator().manual_seed(0)
    prompts = ["buy a red mug", "find blue shoes", "buy a red mug", "find blue shoes"] * 2
    keys, fields = [], {"prompts": [], "responses": [], "response_mask": [], "advantages": [], "old_log_probs": []}
    for i, p in enumerate(prompts):
        pid = torch.as_tensor(tok(p, add_special_tokens=False).input_ids)
        R = int(torch.randint(3, 9, (1,), generator=g))
        rid = torch.randint(3, 250, (R,), generator=g)
        rm = torch.ones(R, dtype=torch.long)
        if i % 3 == 0:
            rm[1] = 0  # a tool-output token splits the response into two turns
        keys.append(f"uid{i // 2}_s{i % 2}_0")
        fields["prompts"].append(pid)
        fields["responses"].append(rid)
        fields["response_mask"].append(rm)
        fields["advantages"].append(torch.full((R,), float(torch.randn(1, generator=g))))
        fields["old_log_probs"].append(torch.randn(R, generator=g) - 3)
    td = TensorDict({k: torch.nested.as_nested_tensor(v, layout=torch.jagged) for k, v in fields.items()},
                    batch_size=[len(keys)])
    batch = store.kv_batch_put(keys=keys, partition_id="train", fields=td)
    metrics: dict = {}
    tr._compute_advantage(batch, metrics)

    assert all(not k[1].endswith("__icsd_teacher") for k in store.rows)  # teacher rows cleared
    bank = load_skillbank("webshop")
    n = len(keys)
    T = max(r.numel() for r in fields["responses"])
    teacher = torch.zeros(n, T)
    for i in range(n):  # the teacher by hand: block ids + prompt ids, same response, scored by the model
        z = bank.retrieve(prompts[i]).text
        ids = torch.cat([torch.as_tensor(tok(skill_block(z), add_special_tokens=False).input_ids),
                         fields["prompts"][i], fields["responses"][i]])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids.view(1, -1)).logits[0].float(), -1)
        R = fields["responses"][i].numel()
        want = lp[-R - 1:-1].gather(-1, fields["responses"][i].view(-1, 1)).view(-1)
        got = store.rows[("train", keys[i])][iv.TEACHER_KEY]
        assert torch.allclose(got, want, atol=1e-5)
        teacher[i, :R] = got
    # c per global mini-batch: 8 rows, dp 2, mini-batch 2*2 = 4 rows -> rows {0,1,4,5} and {2,3,6,7}
    mask = torch.zeros(n, T, dtype=torch.bool)
    adv, old = torch.zeros(n, T), torch.zeros(n, T)
    for i in range(n):
        R = fields["responses"][i].numel()
        mask[i, :R] = fields["response_mask"][i].bool()
        adv[i, :R], old[i, :R] = fields["advantages"][i], fields["old_log_probs"][i]
    traj, _ = trajectory_turns(keys, mask)
    for rows in ([0, 1, 4, 5], [2, 3, 6, 7]):
        r = torch.as_tensor(rows)
        ref = allocate_padded(advantage=adv[r], ratio=1.0, delta=(teacher - old)[r], response_mask=mask[r],
                              traj_id=traj[r], turn_id=turn_ids_from_mask(mask[r]), min_group=2)
        for j, i in enumerate(rows):
            R = fields["responses"][i].numel()
            assert torch.equal(store.rows[("train", keys[i])][iv.C_KEY], ref.c[j, :R].float())
    assert metrics["icsd/mini_batches"] == 2.0 and "icsd/tcm_icsd" in metrics
    # the mechanism metrics verl's trainer.logger carries (values: tests/integrations/test_mechanism_metrics.py)
    assert np.isclose(metrics["icsd/tcm"], metrics["icsd/tcm_icsd"], equal_nan=True)
    assert sum(metrics[f"icsd/share/{r}"] for r in ("pos_delta_pos_adv", "pos_delta_neg_adv", "neg_delta_pos_adv",
                                                     "neg_delta_neg_adv", "neutral")) == pytest.approx(1.0)
    assert metrics["icsd/c_mass"] == pytest.approx(metrics["icsd/g_mass"]) and 0 <= metrics["icsd/fallback_share"] <= 1

    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.audit.coeffs import compute_coefficients
    import pyarrow.parquet as pq

    shards = sorted((tmp_path / "dumps").glob("*.parquet"))
    assert [p.name for p in shards] == ["part-000000-r00000.parquet", "part-000001-r00000.parquet"]
    import verl

    from icsd_audit.dumps.reader import read_metadata
    from icsd_audit.audit.settings import deployed_options

    meta = read_metadata(shards[0])  # SPEC 9: the deployed settings, the engine, the driver writing for dp 2
    assert meta["allocator"] == {"allocator": "icsd", "trust": "laplace", "trust_beta": 5.0, "trust_eta": 0.4,
                                 "influence_eta": 0.5, "eps": 1e-4, "min_group": 2, "alloc_scope": "mini-batch",
                                 "ratio_source": "fixed-1", "seed": 0, "lambda": 0.05}
    p = meta["producer"]
    assert (p["engine"], p["engine_version"], p["rank"], p["world_size"]) == ("verl", verl.__version__, 0, 2)
    compute_coefficients(shards, tmp_path / "c.parquet")  # with the recorded settings
    assert deployed_options(shards) == AllocatorOptions(min_group=2)
    rec = pq.read_table(tmp_path / "c.parquet")
    dumped = np.concatenate([pq.read_table(p).column("c").to_numpy() for p in shards])
    assert np.array_equal(rec.column("c").to_numpy().astype(np.float32), dumped)
    assert set(rec.column("batch_id").to_numpy().tolist()) == {7000, 7001}


def test_icsd_sync_dumps_the_entropy_of_verls_old_log_prob_pass(setup, tmp_path):
    """SPEC 11: verl's old-log-prob pass leaves ``entropy`` (response-aligned, from the logits that gave
    ``old_log_probs``) in the store; the driver's shards carry it as the float32 ``entropy`` column, equal to a
    float64 entropy of the model's logits token by token (the pass here is verl's ``entropy_from_logits``)."""
    from verl.utils import torch_functional as verl_F
    import pyarrow.parquet as pq

    tr, store, model, tok = setup
    tr.on_init_end()
    g = torch.Generator().manual_seed(1)
    keys, fields, ref = [], {k: [] for k in ("prompts", "responses", "response_mask", "advantages", "old_log_probs",
                                             "entropy")}, []
    for i, p in enumerate(["buy a red mug", "find blue shoes"] * 4):
        pid = torch.as_tensor(tok(p, add_special_tokens=False).input_ids)
        R = int(torch.randint(3, 9, (1,), generator=g))
        rid = torch.randint(3, 250, (R,), generator=g)
        rm = torch.ones(R, dtype=torch.long)
        if i % 3 == 0:
            rm[1] = 0  # two turns
        with torch.no_grad():
            z = model(input_ids=torch.cat([pid, rid]).view(1, -1)).logits[0, pid.numel() - 1:-1].float()
        lp = torch.log_softmax(z.double(), -1)
        ref.append(-(lp.exp() * lp).sum(-1))
        keys.append(f"uid{i // 2}_s{i % 2}_0")
        for k, v in (("prompts", pid), ("responses", rid), ("response_mask", rm), ("entropy", verl_F.entropy_from_logits(z)),
                     ("advantages", torch.full((R,), float(torch.randn(1, generator=g)))),
                     ("old_log_probs", lp.gather(-1, rid.view(-1, 1)).view(-1).float())):
            fields[k].append(v)
    td = TensorDict({k: torch.nested.as_nested_tensor(v, layout=torch.jagged) for k, v in fields.items()},
                    batch_size=[len(keys)])
    tr._compute_advantage(store.kv_batch_put(keys=keys, partition_id="train", fields=td), {})
    T = max(r.numel() for r in fields["responses"])
    mask = torch.zeros(len(keys), T, dtype=torch.bool)
    for i, rm in enumerate(fields["response_mask"]):
        mask[i, :rm.numel()] = rm.bool()
    traj, turn = trajectory_turns(keys, mask)
    pos = torch.cumsum(mask.long(), 1) - 1
    want = {(int(traj[i]), int(turn[i, t]), int(pos[i, t])): float(ref[i][t])
            for i in range(len(keys)) for t in range(T) if mask[i, t]}
    t = pq.read_table(sorted((tmp_path / "dumps").glob("*.parquet")))
    got = t.column("entropy").to_numpy()
    keys_d = zip(*(t.column(k).to_numpy().tolist() for k in ("traj_id", "turn_id", "pos")))
    exp = np.array([want[k] for k in keys_d])
    assert got.dtype == np.float32 and len(got) == len(want) and np.ptp(exp) > 1e-3
    np.testing.assert_allclose(got, exp, atol=1e-5, rtol=0)


def test_shuffled_mini_batches_are_refused(setup):
    tr, *_ = setup
    tr.config.actor_rollout_ref.actor.shuffle = True
    with pytest.raises(ValueError, match="shuffle=false"):
        tr.on_init_end()


def test_unknown_icsd_option():
    with pytest.raises(ValueError, match="unknown icsd option"):
        ICSDVerlConfig.from_config({"distil_coef": 0.1})
    with pytest.raises(ValueError, match="icsd.gigpo_mode='std': choose 'mean_norm' or 'mean_std_norm'"):
        ICSDVerlConfig.from_config({"gigpo_mode": "std"})
    cfg = ICSDVerlConfig.from_config({"step_weight": 0.3, "gigpo_mode": "mean_std_norm", "gigpo_epsilon": 1e-5})
    assert (cfg.step_weight, cfg.gigpo_mode, cfg.gigpo_epsilon) == (0.3, "mean_std_norm", 1e-5)


def test_every_overridden_verl_method_has_a_signature_check():
    cls = register()
    methods = [k for k, v in vars(cls).items() if callable(v) and not k.startswith("__")]
    overridden = sorted(k for k in methods if hasattr(PPOTrainerSync, k))
    assert overridden == ["_compute_advantage", "on_init_end"]
    assert sorted(set(methods) - set(overridden)) == ["_gigpo_advantage"]  # ours: verl must not define it
    for name in overridden:
        assert f"verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.{name}" in iv.EXPECTED_SIGNATURES, name


def test_every_called_verl_function_has_a_signature_check():
    """Every function the integration modules import from verl or TransferQueue (and call) is checked at plug-in
    load; found from the modules' source, so a new call without a check fails here."""
    import ast
    import importlib
    import inspect
    from pathlib import Path

    import icsd_audit.integrations as pkg

    called = set()
    for path in (Path(pkg.__file__).parent / "verl").glob("*.py"):  # the verl integration package
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "verl":
                called |= {f"{node.module}:{a.name}" for a in node.names}
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tq":
                called.add(f"transfer_queue:{node.attr}")
    functions = {c for c in called if inspect.isfunction(getattr(importlib.import_module(c.split(":")[0]),
                                                                  c.split(":")[1]))}
    assert {"verl.trainer.ppo.core_algos:get_adv_estimator_fn", "verl.trainer.ppo.core_algos:register_adv_est",
            "verl.trainer.ppo.ray_trainer:apply_kl_penalty", "transfer_queue:kv_batch_get"} <= functions
    assert sorted(functions - set(iv.EXPECTED_SIGNATURES)) == []
    assert "verl.protocol:DataProto.__init__" in iv.EXPECTED_SIGNATURES  # the one class we construct


# (key, observations in front of turns 1, 2, ... (None: a padding row), the session's score); session u0_s0 and
# u2_s1 span two rows each, and verl's agent loop copies the final score onto the earlier row
_GIGPO_PLAN = [("u0_s0_0", "ab", 1.0), ("u0_s0_1", "c", 1.0), ("u0_s1_0", "a", 0.0), ("u1_s0_0", "ca", 0.5),
               ("u1_s1_0", "cb", 0.0), ("u2_s0_0", "", 1.0), ("u2_s1_0", "b", 0.25), ("u2_s1_1", "ab", 0.25),
               ("u3_s0_0", "a", 1.0), ("u3_s1_0", "a", 0.0), ("pad9_0_0", None, 0.0), ("pad9_1_0", None, 0.0)]
_FINAL = [False, True, True, True, True, True, False, True, True, True, True, True]
_OBS = {"a": [200, 201], "b": [202], "c": [203, 204, 205]}


def _gigpo_rows(tok):
    g = torch.Generator().manual_seed(3)
    tasks = ["buy a red mug", "find blue shoes", "buy a red mug", "find blue shoes", "pad"]
    rows = []
    for i, (key, obs, score) in enumerate(_GIGPO_PLAN):
        u = int(key[1]) if key.startswith("u") else 4
        prompt = tok(tasks[u], add_special_tokens=False).input_ids
        if key.endswith("_1"):  # a later output of the session: its prompt holds the history
            prompt = rows[-1]["prompt"] + rows[-1]["response"] + [206]
        if obs is None:
            resp, mask = [2], [0]
        else:
            resp, mask = [], []
            for k, o in enumerate([""] + list(obs)):
                resp += _OBS.get(o, [])
                mask += [0] * len(_OBS.get(o, []))
                n = int(torch.randint(1, 4, (1,), generator=g))
                resp += torch.randint(3, 199, (n,), generator=g).tolist()
                mask += [1] * n
            if i % 3 == 0:
                resp, mask = resp + [207], mask + [0]  # a trailing observation: the score lands on it
        R = len(resp)
        rows.append(dict(key=key, prompt=prompt, response=resp, mask=mask, score=[0.0] * (R - 1) + [score],
                         old=(torch.randn(R, generator=g) - 3).tolist(), ref=(torch.randn(R, generator=g) - 3).tolist()))
    return rows


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_icsd_sync_gigpo_driver_step(tmp_path, monkeypatch, kl_in_reward):
    from verl.trainer.ppo import core_algos

    from tests.integrations.test_verl_gigpo import _h, _runs, reference

    beta = 0.2
    tr, store, model, tok = _trainer(tmp_path, monkeypatch, [
        "algorithm.adv_estimator=gigpo", "algorithm.gamma=0.9", "+icsd.step_weight=0.5",
        f"algorithm.use_kl_in_reward={str(kl_in_reward).lower()}", f"algorithm.kl_ctrl.kl_coef={beta}"])
    tr.on_init_end()
    tr.kl_ctrl_in_reward = core_algos.get_kl_controller(tr.config.algorithm.kl_ctrl)  # what verl's __init__ sets
    monkeypatch.setattr(PPOTrainerSync, "_compute_advantage", lambda *a: pytest.fail("verl's GRPO path ran"))
    rows = _gigpo_rows(tok)
    keys = [r["key"] for r in rows]
    nt = lambda xs, dt: torch.nested.as_nested_tensor([torch.tensor(x, dtype=dt) for x in xs],  # noqa: E731
                                                      layout=torch.jagged)
    fields = {"prompts": ("prompt", torch.long), "responses": ("response", torch.long),
              "response_mask": ("mask", torch.long), "rm_scores": ("score", torch.float32),
              "old_log_probs": ("old", torch.float32), "rollout_log_probs": ("old", torch.float32),
              "ref_log_prob": ("ref", torch.float32)}
    td = TensorDict({f: nt([r[c] for r in rows], dt) for f, (c, dt) in fields.items()}, batch_size=[len(rows)])
    metrics: dict = {}
    tr._compute_advantage(store.kv_batch_put(keys=keys, partition_id="train", fields=td), metrics)

    # the reference, worked out row by row: the final row's score only, verl's KL penalty (k1) on the tokens,
    # anchors hashed from the ids by hand, turns numbered on across a session's rows
    n, T = len(rows), max(len(r["response"]) for r in rows)
    mask, rewards, copied = torch.zeros(n, T, dtype=torch.long), torch.zeros(n, T), torch.zeros(n, T)
    anchor = torch.zeros(n, T, dtype=torch.long)
    offset, seen = [], {}
    for i, r in enumerate(rows):
        R = len(r["response"])
        m = torch.tensor(r["mask"])
        mask[i, :R] = m
        kl = (torch.tensor(r["old"]) - torch.tensor(r["ref"])) * m if kl_in_reward else torch.zeros(R)
        rewards[i, :R] = torch.tensor(r["score"]) * float(_FINAL[i]) - beta * kl
        copied[i, :R] = torch.tensor(r["score"]) - beta * kl
        runs = _runs(r["mask"])
        for k, (s, e) in enumerate(runs):
            anchor[i, s:e] = _h(r["prompt"] + r["response"][:s] if k == 0 else r["response"][runs[k - 1][1]:s])
        session = r["key"].rsplit("_", 1)[0]
        offset.append(seen.get(session, 0))
        seen[session] = offset[-1] + len(runs)
    assert offset == [0, 3, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0]
    group = [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    traj = [0, 0, 1, 0, 1, 0, 1, 1, 0, 1, 0, 1]
    opts = dict(gamma=0.9, step_weight=0.5, mode="mean_norm", epsilon=1e-6)
    want = reference(rewards, mask, group, traj, offset, anchor, **opts)
    assert not torch.equal(want, reference(copied, mask, group, traj, offset, anchor, **opts))  # copy counted twice
    for i, k in enumerate(keys):
        R = len(rows[i]["response"])
        got = store.rows[("train", k)]
        assert torch.equal(got["advantages"], want[i, :R]) and torch.equal(got["returns"], want[i, :R]), k
        assert torch.equal(got["response_mask"], mask[i, :R])  # rollout correction ran, rejected nothing
        if kl_in_reward:
            assert torch.equal(got["token_level_rewards"], rewards[i, :R])
    assert metrics["icsd/gigpo_step_groups"] > 0 and any(k.startswith("rollout_corr/") for k in metrics)
    assert ("actor/reward_kl_penalty" in metrics) == kl_in_reward

    # then the allocation as before, on GiGPO's advantages: 12 rows, dp 2, mini-batches of 4 rows
    teacher, old = torch.zeros(n, T), torch.zeros(n, T)
    for i, r in enumerate(rows):
        R = len(r["response"])
        teacher[i, :R], old[i, :R] = store.rows[("train", keys[i])][iv.TEACHER_KEY], torch.tensor(r["old"])
    traj_id, turn = trajectory_turns(keys, mask)
    for mb in ([0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]):
        r_ = torch.as_tensor(mb)
        ref = allocate_padded(advantage=want[r_], ratio=1.0, delta=(teacher - old)[r_], response_mask=mask[r_].bool(),
                              traj_id=traj_id[r_], turn_id=turn[r_], min_group=2)
        for j, i in enumerate(mb):
            assert torch.equal(store.rows[("train", keys[i])][iv.C_KEY], ref.c[j, :len(rows[i]["response"])].float())
    assert metrics["icsd/mini_batches"] == 3.0


def test_icsd_sync_micro_batch_scope_hands_the_allocation_to_the_worker_loss(tmp_path, monkeypatch):
    """+icsd.alloc_scope=micro-batch: the driver runs the teacher pass and stores the teacher log-probs, each row's
    first turn index within its session and the step; it allocates nothing and writes no dump (the worker loss
    allocates every micro-batch from its own forward and writes them)."""
    from icsd_audit.integrations.verl.loss import STEP_KEY, TURN_OFFSET_KEY, MicroBatchScope

    tr, store, model, tok = _trainer(tmp_path, monkeypatch, extra=["+icsd.alloc_scope=micro-batch",
                                                                   "+icsd.trust=sigmoid"])
    tr.on_init_end()
    fn = tr.actor_rollout_wg.loss_fn
    assert fn.func is iv.icsd_ppo_loss
    assert fn.keywords["micro"] == MicroBatchScope(allocator="icsd", trust="sigmoid", min_group=2,
                                                   dump_dir=str(tmp_path / "dumps"), producer="icsd.verl.icsd_sync")
    g = torch.Generator().manual_seed(5)
    keys = ["u0_s0_0", "u0_s0_1", "u0_s1_0", "u1_s0_0"]  # u0_s0 spans two rows
    masks = [[1, 1, 0, 1], [1, 0, 1, 1, 1], [1, 1], [1, 1, 1]]  # u0_s0's first row holds two turns
    fields = {"prompts": [], "responses": [], "response_mask": [], "advantages": [], "old_log_probs": []}
    for k, m in zip(keys, masks):
        fields["prompts"].append(torch.as_tensor(tok("buy a red mug", add_special_tokens=False).input_ids))
        fields["responses"].append(torch.randint(3, 250, (len(m),), generator=g))
        fields["response_mask"].append(torch.tensor(m))
        fields["advantages"].append(torch.full((len(m),), 0.5))
        fields["old_log_probs"].append(torch.randn(len(m), generator=g) - 3)
    td = TensorDict({k: torch.nested.as_nested_tensor(v, layout=torch.jagged) for k, v in fields.items()},
                    batch_size=[len(keys)])
    batch = store.kv_batch_put(keys=keys, partition_id="train", fields=td)
    metrics: dict = {}
    tr._compute_advantage(batch, metrics)
    rows = [store.rows[("train", k)] for k in keys]
    assert [int(r[TURN_OFFSET_KEY]) for r in rows] == [0, 2, 0, 0]
    assert [int(r[STEP_KEY]) for r in rows] == [7, 7, 7, 7]
    assert all(iv.TEACHER_KEY in r and iv.C_KEY not in r for r in rows)
    assert "icsd/tcm_icsd" not in metrics and not (tmp_path / "dumps").exists()


def test_icsd_sync_refuses_a_nan_advantage_naming_the_verl_key(setup, tmp_path):
    tr, store, model, tok = setup
    tr.on_init_end()
    keys = ["u0_s0_0", "u0_s1_0", "u1_s0_0", "u1_s1_0"]  # 2 ranks x one mini-batch of 2 rows
    adv = [torch.tensor([0.1, 0.1, 0.1]), torch.tensor([0.2, float("nan"), 0.2])] + [torch.tensor([0.3] * 3)] * 2
    fields = {"prompts": [torch.tensor([5, 6, 7])] * 4, "responses": [torch.tensor([8, 9, 10])] * 4,
              "response_mask": [torch.tensor([1, 1, 1])] * 4, "advantages": adv,
              "old_log_probs": [torch.tensor([-1.0, -2.0, -3.0])] * 4}
    td = TensorDict({k: torch.nested.as_nested_tensor(v, layout=torch.jagged) for k, v in fields.items()},
                    batch_size=[4])
    batch = store.kv_batch_put(keys=keys, partition_id="train", fields=td)
    with pytest.raises(ValueError, match=r"^advantages is nan at row 1 \(key 'u0_s1_0'\), response token 1"):
        tr._compute_advantage(batch, {})
    assert not list((tmp_path / "dumps").glob("*.parquet"))
