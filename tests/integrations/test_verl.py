"""The verl worker loss on real verl config and batch objects, the plug-in, and signature tests."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")

from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from icsd_audit.integrations.verl import plugin as iv  # noqa: E402

pytestmark = pytest.mark.engines
torch.set_num_threads(1)
LAM = 0.37


@pytest.fixture(scope="module")
def actor_config():
    from hydra import compose, initialize_config_dir
    import verl
    from verl.utils.config import omega_conf_to_dataclass

    d = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    with initialize_config_dir(config_dir=d, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.n=1", "data.train_batch_size=4", "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.05", "actor_rollout_ref.actor.entropy_coeff=0.01"])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def _rows(seed: int, B: int = 5):
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(2, 6, (B,), generator=g)
    r_len = torch.randint(1, 7, (B,), generator=g)
    rows = []
    for b in range(B):
        P, R = int(p_len[b]), int(r_len[b])
        rows.append(dict(P=P, R=R,
                         old=torch.randn(R, generator=g, dtype=torch.float64) - 2,
                         ref=torch.randn(R, generator=g, dtype=torch.float64) - 2,
                         adv=torch.full((R,), float(torch.randn(1, generator=g))),
                         teacher=torch.randn(R, generator=g, dtype=torch.float64) - 2,
                         c=torch.rand(R, generator=g, dtype=torch.float64) * 2))
    n_tot = sum(r["P"] + r["R"] for r in rows)
    values = (torch.randn(n_tot, generator=g, dtype=torch.float64) - 2).requires_grad_(True)
    ent = torch.rand(n_tot, generator=g, dtype=torch.float64)
    return rows, values, ent


def _padded(rows, n_tokens, dp_size=1):
    B = len(rows)
    Pm, Rm = max(r["P"] for r in rows), max(r["R"] for r in rows)
    prompts = torch.zeros(B, Pm, dtype=torch.long)
    responses = torch.zeros(B, Rm, dtype=torch.long)
    am = torch.zeros(B, Pm + Rm, dtype=torch.long)
    f = {k: torch.zeros(B, Rm, dtype=torch.float64) for k in ("old", "ref", "adv", "teacher", "c")}
    rm = torch.zeros(B, Rm, dtype=torch.long)
    for b, r in enumerate(rows):
        am[b, Pm - r["P"]:Pm] = 1  # left-padded prompt
        am[b, Pm:Pm + r["R"]] = 1
        rm[b, : r["R"]] = 1
        for k in f:
            f[k][b, : r["R"]] = r[k]
    td = TensorDict({"prompts": prompts, "responses": responses, "attention_mask": am, "response_mask": rm,
                     "old_log_probs": f["old"], "ref_log_prob": f["ref"], "advantages": f["adv"],
                     iv.TEACHER_KEY: f["teacher"], iv.C_KEY: f["c"]}, batch_size=[B])
    tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=n_tokens, global_batch_size=None)
    return td


def _jagged(rows, n_tokens, dp_size=1):
    B = len(rows)

    def nt(xs):
        return torch.nested.nested_tensor(xs, layout=torch.jagged)

    td = TensorDict({"prompts": nt([torch.ones(r["P"], dtype=torch.long) for r in rows]),
                     "responses": nt([torch.ones(r["R"], dtype=torch.long) for r in rows]),
                     "response_mask": nt([torch.ones(r["R"], dtype=torch.long) for r in rows]),
                     "old_log_probs": nt([r["old"] for r in rows]), "ref_log_prob": nt([r["ref"] for r in rows]),
                     "advantages": nt([r["adv"] for r in rows]), iv.TEACHER_KEY: nt([r["teacher"] for r in rows]),
                     iv.C_KEY: nt([r["c"] for r in rows])}, batch_size=[B])
    tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=n_tokens, global_batch_size=None)
    return td


def _model_output(rows, values, ent, jagged):
    if jagged:
        offs = torch.tensor([0] + [r["P"] + r["R"] for r in rows]).cumsum(0)
        return {"log_probs": torch.nested.nested_tensor_from_jagged(values, offs),
                "entropy": torch.nested.nested_tensor_from_jagged(ent, offs)}
    return {"log_probs": values, "entropy": ent}


def _aux_by_hand(rows, values, n_tokens):
    """sum c (T - logp) / |B| with logp read off the flat model output by hand (verl's shift: token j of the
    response is predicted at sequence position P + j - 1)."""
    tot, off = 0.0, 0
    grad = torch.zeros_like(values)
    for r in rows:
        for j in range(r["R"]):
            i = off + r["P"] + j - 1
            tot += float(r["c"][j]) * (float(r["teacher"][j]) - float(values[i].detach()))
            grad[i] = -float(r["c"][j]) / n_tokens
        off += r["P"] + r["R"]
    return tot / n_tokens, grad


@pytest.mark.parametrize("jagged", [False, True])
def test_loss_is_verl_ppo_loss_plus_aux_with_gradients(actor_config, jagged):
    rows, values, ent = _rows(0)
    n = sum(r["R"] for r in rows)
    make = _jagged if jagged else _padded
    cfg1, cfg2 = copy.deepcopy(actor_config), copy.deepcopy(actor_config)
    base, _ = ppo_loss(cfg1, _model_output(rows, values, ent, jagged), make(rows, n))
    (g_base,) = torch.autograd.grad(base, values)
    got, metrics = iv.icsd_ppo_loss(cfg2, _model_output(rows, values, ent, jagged), make(rows, n), distill_coef=LAM)
    (g_got,) = torch.autograd.grad(got, values)
    aux, g_aux = _aux_by_hand(rows, values, n)
    assert float(got.detach()) == pytest.approx(float(base.detach()) + LAM * aux, rel=1e-12, abs=1e-12)
    assert torch.allclose(g_got, g_base + LAM * g_aux, rtol=1e-12, atol=1e-14)
    assert float(metrics["actor/icsd_aux_loss"].values[0]) == pytest.approx(aux, rel=1e-12)


@pytest.mark.parametrize("jagged", [False, True])
def test_micro_batches_accumulate_to_the_mini_batch(actor_config, jagged):
    rows, values, ent = _rows(1, B=6)
    n = sum(r["R"] for r in rows)
    make = _jagged if jagged else _padded
    full, _ = iv.icsd_ppo_loss(copy.deepcopy(actor_config), _model_output(rows, values, ent, jagged), make(rows, n),
                               distill_coef=LAM)
    (g_full,) = torch.autograd.grad(full, values)
    total, grads, off = 0.0, torch.zeros_like(values), 0
    for part in (rows[:2], rows[2:3], rows[3:]):  # uneven micro-batches, verl's global token count
        k = sum(r["P"] + r["R"] for r in part)
        v = values.detach()[off:off + k].clone().requires_grad_(True)
        loss, _ = iv.icsd_ppo_loss(copy.deepcopy(actor_config), _model_output(part, v, ent[off:off + k], jagged),
                                   make(part, n), distill_coef=LAM)
        (g,) = torch.autograd.grad(loss, v)
        grads[off:off + k] = g
        total += float(loss.detach())
        off += k
    assert total == pytest.approx(float(full.detach()), rel=1e-12, abs=1e-12)
    assert torch.allclose(grads, g_full, rtol=1e-12, atol=1e-14)


def test_missing_keys_are_a_clear_error(actor_config):
    rows, values, ent = _rows(2)
    td = _padded(rows, sum(r["R"] for r in rows))
    del td[iv.C_KEY]
    with pytest.raises(KeyError, match="the batch has no icsd_c"):
        iv.icsd_ppo_loss(copy.deepcopy(actor_config), _model_output(rows, values, ent, False), td)


def test_signatures_of_everything_we_wrap():
    assert iv.check_verl() == "0.9.1" or iv.check_verl().startswith("0.9")
    import inspect

    for path, params in iv.EXPECTED_SIGNATURES.items():
        fn = inspect.unwrap(iv.resolve_dotted(path))
        assert tuple(inspect.signature(fn).parameters)[: len(params)] == params, path


def test_signature_change_fails_loudly(monkeypatch):
    import verl.workers.utils.losses as L

    def ppo_loss(cfg, out, data):  # a "new verl" with a renamed parameter
        return None

    monkeypatch.setattr(L, "ppo_loss", ppo_loss)
    with pytest.raises(iv.VerlCompatError, match="changed verl.workers.utils.losses:ppo_loss"):
        iv.check_verl()


def _fresh(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "auto", "PYTHONWARNINGS": "default"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_plugin_registers_in_a_fresh_process():
    r = _fresh("import sys, verl\nfrom verl.trainer.ppo.v1 import get_trainer_cls\n"
               "from verl.trainer.ppo.core_algos import get_adv_estimator_fn\n"
               "fn = get_adv_estimator_fn('gigpo')\n"
               "print('icsd_audit.integrations.verl.plugin' in sys.modules, get_trainer_cls('icsd_sync').__name__, "
               "fn.__module__ + '.' + fn.__name__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("True ICSDTrainerSync icsd_audit.integrations.verl.gigpo.compute_gigpo_advantage"), \
        r.stdout + r.stderr


@pytest.mark.parametrize("first", ["icsd_audit.integrations.verl.trainer", "icsd_audit.integrations.verl.gigpo",
                                   "icsd_audit.integrations.sdar"])
def test_any_integration_module_imports_first(first):
    # importing the trainer module first used to run the plug-in (through import verl), which imported
    # the half-initialized trainer module back: 'cannot import name register'
    r = _fresh(f"import {first}\nfrom verl.trainer.ppo.v1 import get_trainer_cls\n"
               "print(get_trainer_cls('icsd_sync').__name__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ICSDTrainerSync"), r.stdout + r.stderr


def test_plugin_that_cannot_register_says_so_loudly():
    code = ("import icsd_audit.integrations.verl.plugin as m, icsd_audit.integrations.verl.compat as c\n"
            "c.TESTED_VERL = ('99.0', '100.0')\n"
            "try:\n    m._plugin_check()\nexcept m.VerlCompatError:\n    print('raised')\n")
    r = _fresh(code)
    assert "raised" in r.stdout
    assert "icsd verl plug-in cannot register: verl 0.9.1 is outside the tested range [99.0, 100.0)" in r.stderr
