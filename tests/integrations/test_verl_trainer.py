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

pytest.importorskip("verl", reason="verl not installed: pip install 'icsd[verl]'")
tq = pytest.importorskip("transfer_queue", reason="TransferQueue not installed: pip install 'icsd[verl]'")

from tensordict import TensorDict  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402

from icsd_audit.integrations import verl as iv  # noqa: E402
from icsd_audit.integrations.core import allocate_padded, turn_ids_from_mask  # noqa: E402
from icsd_audit.integrations.verl_trainer import (ICSDVerlConfig, register, trajectory_turns,  # noqa: E402
                                                  v1_mini_batch_ids)
from icsd_audit.train.models import tiny_random_causal_lm  # noqa: E402
from icsd_audit.train.prompts import skill_block  # noqa: E402
from icsd_audit.train.skills import load_skillbank  # noqa: E402

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


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    import verl

    d = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    with initialize_config_dir(config_dir=d, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "data.train_batch_size=4", "+icsd.min_group=2", "+icsd.distill_coef=0.05",
            f"+icsd.dump_dir={tmp_path / 'dumps'}"])
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

    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.dumps.coeffs import compute_coefficients
    import pyarrow.parquet as pq

    shards = sorted((tmp_path / "dumps").glob("*.parquet"))
    assert [p.name for p in shards] == ["part-000000-r00000.parquet", "part-000001-r00000.parquet"]
    compute_coefficients(shards, tmp_path / "c.parquet", AllocatorOptions(min_group=2))
    rec = pq.read_table(tmp_path / "c.parquet")
    dumped = np.concatenate([pq.read_table(p).column("c").to_numpy() for p in shards])
    assert np.array_equal(rec.column("c").to_numpy().astype(np.float32), dumped)
    assert set(rec.column("batch_id").to_numpy().tolist()) == {7000, 7001}


def test_shuffled_mini_batches_are_refused(setup):
    tr, *_ = setup
    tr.config.actor_rollout_ref.actor.shuffle = True
    with pytest.raises(ValueError, match="shuffle=false"):
        tr.on_init_end()


def test_unknown_icsd_option():
    with pytest.raises(ValueError, match="unknown icsd option"):
        ICSDVerlConfig.from_config({"distil_coef": 0.1})


def test_every_overridden_verl_method_has_a_signature_check():
    cls = register()
    overridden = [k for k, v in vars(cls).items() if callable(v) and not k.startswith("__")]
    assert sorted(overridden) == ["_compute_advantage", "on_init_end"]
    for name in overridden:
        assert f"verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.{name}" in iv.EXPECTED_SIGNATURES, name
