"""recording(loss_fn, dump_dir): verl's own ppo_loss / distillation_ppo_loss, unchanged, and their rows dumped."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")

from verl.trainer.distillation.losses import distillation_ppo_loss  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from icsd_audit.integrations.verl.record import recording  # noqa: E402
from tests.integrations.test_verl_micro import _batch, _configs  # noqa: E402

pytestmark = pytest.mark.engines
torch.set_num_threads(1)


def _same(a, b):
    """(loss, metrics) pairs equal: the loss bit for bit, the metric keys and values."""
    assert torch.equal(torch.as_tensor(a[0]), torch.as_tensor(b[0]))
    assert a[1].keys() == b[1].keys()


@pytest.mark.parametrize("mode,task,pg", [("k3", True, False), ("k1", False, True)])
def test_distillation_ppo_loss_recorded_equals_verl_in_value_and_gradient(tmp_path, mode, task, pg):
    actor, distill = _configs(loss_mode=mode, use_task_rewards=task, use_policy_gradient=pg)
    rows, values, td, out, n = _batch(3, teacher_layout="verl")
    plain = distillation_ppo_loss(copy.deepcopy(actor), copy.deepcopy(distill), model_output=out,
                                  data=copy.deepcopy(td), dp_group=None)
    (g0,) = torch.autograd.grad(plain[0], values)
    # the worker's form: a partial called with keywords
    rec = recording(functools.partial(distillation_ppo_loss, config=copy.deepcopy(actor),
                                      distillation_config=copy.deepcopy(distill)), tmp_path / "d")
    got = rec(model_output=out, data=copy.deepcopy(td), dp_group=None)
    (g1,) = torch.autograd.grad(got[0], values)
    _same(plain, got)
    assert torch.equal(g0, g1)
    d = read_dump_flat(tmp_path / "d")
    assert len(d["logp"]) == n and d["valid"].all() and (d["c"] == 1).all()
    # the dumped rows are the micro-batch's valid tokens in row order: teacher and logp at verl's shifted positions
    want_t = np.concatenate([r["teacher"][r["mask"].bool()].numpy() for r in rows])
    assert sorted(np.round(d["teacher_logp"], 4)) == sorted(np.round(want_t.astype(np.float32), 4))
    assert np.allclose(d["delta"], d["teacher_logp"] - d["logp"], atol=1e-6)
    lr = d["logp"].astype(np.float64) - d["teacher_logp"]
    want_term = (np.exp(-lr) - 1 + lr) if mode == "k3" else lr  # verl's kl_penalty estimators
    assert np.allclose(d["distill_term"], want_term, rtol=1e-4, atol=1e-6)
    from tests.cli.test_outputs import cli

    v = cli("audit", "verify", str(tmp_path / "d"))
    assert v.returncode == 0, v.stdout + v.stderr


def test_ppo_loss_recorded_positionally_equals_verl_and_says_it_has_no_teacher(tmp_path):
    from icsd_audit.dumps.reader import read_metadata

    actor, _ = _configs()
    rows, values, td, out, n = _batch(5, teacher_layout="verl")
    del td["teacher_logprobs"]
    plain = ppo_loss(copy.deepcopy(actor), out, copy.deepcopy(td))
    (g0,) = torch.autograd.grad(plain[0], values)
    got = recording(ppo_loss, tmp_path / "d")(copy.deepcopy(actor), out, copy.deepcopy(td))
    (g1,) = torch.autograd.grad(got[0], values)
    _same(plain, got)
    assert torch.equal(g0, g1)
    d = read_dump_flat(tmp_path / "d")
    assert np.isnan(d["teacher_logp"]).all() and (d["delta"] == 0).all()
    # verl's ratio of each token: exp(clamp(logp - old, -20, 20)) with logp at the shifted position
    off, want = 0, []
    for r in rows:
        for j in range(r["R"]):
            if r["mask"][j]:
                want.append(float(np.exp(np.clip(float(values[off + r["P"] + j - 1]) - float(r["old"][j]), -20, 20))))
        off += r["P"] + r["R"]
    assert sorted(np.round(d["ratio"], 5)) == sorted(np.round(np.float32(want), 5))
    import glob

    meta = read_metadata(glob.glob(str(tmp_path / "d" / "*.parquet"))[0])
    assert "no_teacher" in meta["producer"] and meta["allocator"]["alloc_scope"] == "micro-batch"


def test_recording_refuses_a_function_that_is_not_a_worker_loss(tmp_path):
    with pytest.raises(TypeError, match="not a verl worker loss"):
        recording(lambda x: x, tmp_path)


def read_dump_flat(path):
    import pyarrow.parquet as pq

    files = sorted(path.glob("*.parquet"))
    tables = [pq.read_table(f) for f in files]
    return {k: np.concatenate([t.column(k).to_numpy(zero_copy_only=False) for t in tables]) for k in tables[0].column_names}


@pytest.mark.parametrize("jagged", [False, True])
def test_ppo_loss_recorded_on_padded_and_jagged_batches(tmp_path, jagged):
    """test_verl's padded (left-padded prompts, attention mask) and jagged layouts: same loss, same gradient, and
    one dumped row per valid response token with verl's logp at the shifted position."""
    from tests.integrations.test_verl import _jagged, _model_output, _padded, _rows

    actor, _ = _configs()
    rows, values, ent = _rows(7)
    n = sum(r["R"] for r in rows)
    td = (_jagged if jagged else _padded)(rows, n)
    out = _model_output(rows, values, ent, jagged)
    plain = ppo_loss(copy.deepcopy(actor), out, copy.deepcopy(td))
    (g0,) = torch.autograd.grad(plain[0], values)
    got = recording(ppo_loss, tmp_path / "d")(config=copy.deepcopy(actor), model_output=out, data=copy.deepcopy(td))
    (g1,) = torch.autograd.grad(got[0], values)
    _same(plain, got)
    assert torch.equal(g0, g1)
    d = read_dump_flat(tmp_path / "d")
    off, want = 0, []
    for r in rows:
        want += [float(values[off + r["P"] + j - 1]) for j in range(r["R"])]
        off += r["P"] + r["R"]
    assert np.array_equal(d["logp"], np.float32(want))  # rows in (trajectory = row, position) order
    assert np.array_equal(d["advantage"], np.float32(np.concatenate([r["adv"].numpy() for r in rows])))


def test_topk_distillation_recorded_equals_verl_and_nulls_tokens_outside_the_teachers_topk(tmp_path):
    """forward_kl_topk as the final loss (the logits processor already left its per-token losses in the model
    output): same loss and gradient; teacher_logp is the teacher's top-k entry of the sampled token, null where
    the token is not among the teacher's ids; distill_term is verl's per-token loss."""
    from verl.utils import tensordict_utils as tu

    K = 3
    actor, distill = _configs(loss_mode="forward_kl_topk", topk=K, use_task_rewards=True)
    rows, values, td, out, n = _batch(11, teacher_layout="verl")
    g = torch.Generator().manual_seed(11)

    def nt(xs):
        return torch.nested.nested_tensor(xs, layout=torch.jagged)

    resp, tids, tlps, want = [], [], [], []
    for b, r in enumerate(rows):
        ids = torch.randint(10, 50, (r["R"],), generator=g)
        L = r["P"] + r["R"]
        t_ids = torch.randint(10, 50, (L, K), generator=g)
        t_lp = -torch.rand(L, K, generator=g, dtype=torch.float64) * 3
        for j in range(r["R"]):
            t_ids[r["P"] + j - 1] = 5  # an id no sampled token has (they are 10..49)
            if j % 2 == 0:  # every other token: the sampled token is in the teacher's top-k, at slot j % K
                t_ids[r["P"] + j - 1, j % K] = ids[j]
            if r["mask"][j]:
                want.append(float(t_lp[r["P"] + j - 1, j % K]) if j % 2 == 0 else float("nan"))
        resp.append(ids)
        tids.append(t_ids)
        tlps.append(t_lp)
    fields = {k: td[k] for k in ("prompts", "response_mask", "old_log_probs", "advantages")}
    fields.update(responses=nt(resp), teacher_ids=nt(tids), teacher_logprobs=nt(tlps))
    data = tu.get_tensordict({**fields, "uid": [r["uid"] for r in rows], "session_id": [r["s"] for r in rows]})
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=n, global_batch_size=None)
    offs = out["log_probs"].offsets()
    n_tot = int(offs[-1])
    losses = torch.rand(n_tot, generator=g, dtype=torch.float64)
    base = out

    def model_output():  # the top-k losses depend on the policy (a fresh graph per call)
        return {**base, "distillation_losses": torch.nested.nested_tensor_from_jagged(0.5 * values + losses, offs),
                "student_mass": torch.nested.nested_tensor_from_jagged(torch.full((n_tot,), 0.9, dtype=torch.float64),
                                                                       offs),
                "teacher_mass": torch.nested.nested_tensor_from_jagged(torch.full((n_tot,), 0.8, dtype=torch.float64),
                                                                       offs)}

    plain = distillation_ppo_loss(copy.deepcopy(actor), copy.deepcopy(distill), model_output(), copy.deepcopy(data))
    (g0,) = torch.autograd.grad(plain[0], values)
    rec = recording(functools.partial(distillation_ppo_loss, config=copy.deepcopy(actor),
                                      distillation_config=copy.deepcopy(distill)), tmp_path / "d")
    got = rec(model_output=model_output(), data=copy.deepcopy(data), dp_group=None)
    (g1,) = torch.autograd.grad(got[0], values)
    _same(plain, got)
    assert torch.equal(g0, g1)
    d = read_dump_flat(tmp_path / "d")
    got_t = np.sort(d["teacher_logp"][~np.isnan(d["teacher_logp"])])
    want = np.array(want)
    assert np.isnan(d["teacher_logp"]).sum() == np.isnan(want).sum() > 0
    assert np.allclose(got_t, np.sort(np.float32(want[~np.isnan(want)])))
    assert (d["delta"][np.isnan(d["teacher_logp"])] == 0).all()
    off, term = 0, []
    for r in rows:
        term += [max(0.0, float(0.5 * values[off + r["P"] + j - 1] + losses[off + r["P"] + j - 1]))
                 for j in range(r["R"]) if r["mask"][j]]
        off += r["P"] + r["R"]
    assert np.allclose(np.sort(d["distill_term"]), np.sort(np.float32(term)))
