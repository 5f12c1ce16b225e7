"""``+icsd.record=true``: verl's v1 trainer records its own worker loss, unchanged; the legacy trainer and
icsd_sync refuse it in one line; ``icsd train --engine verl --dry-run`` writes such a command
(``verl_record_only``), which composes with verl's own config."""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")

from verl.trainer.distillation.losses import distillation_ppo_loss  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from icsd_audit.integrations.checks import EngineUnavailable  # noqa: E402
from icsd_audit.integrations.verl.launch import verl_overrides  # noqa: E402
from icsd_audit.integrations.verl.record import (refuse_legacy, register_switch, switch_settings,  # noqa: E402
                                                 worker_loss)
from icsd_audit.train.config import TrainConfig  # noqa: E402
from tests.integrations.test_verl_micro import _batch  # noqa: E402
from tests.integrations.test_verl_record import _same, read_dump_flat  # noqa: E402

pytestmark = pytest.mark.engines
torch.set_num_threads(1)

#: what a user adds to turn on verl's own distillation (a served teacher, an estimator loss)
DISTILL = ["distillation.enabled=true", "distillation.n_gpus_per_node=2", "distillation.nnodes=1",
           "distillation.teacher_models.teacher_model.model_path=/models/teacher",
           "distillation.distillation_loss.loss_mode=k3", "distillation.distillation_loss.use_task_rewards=true"]


def _compose(overrides):
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def _record_only(tmp_path, **kw):
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), model="/models/qwen", adv_estimator="grpo",
                      verl_record_only=True, **kw)
    return cfg, verl_overrides(cfg)


def test_the_record_only_command_runs_verls_sync_trainer_with_only_the_switch(tmp_path):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    cfg, ovr = _record_only(tmp_path)
    assert [o for o in ovr if o.startswith("+icsd.")] == ["+icsd.record=true", f"+icsd.dump_dir={tmp_path}/run/dumps"]
    for extra in ([], DISTILL):  # as written, and with verl's own distillation added by the user
        c = _compose([*ovr, *extra])
        validate_config(c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
        assert c.trainer.use_v1 is True and c.trainer.v1.trainer_mode == "sync"
        assert switch_settings(c) == (True, f"{tmp_path}/run/dumps")
        fn = worker_loss(c)
        if extra:
            assert fn.func is distillation_ppo_loss and fn.keywords["distillation_config"].distillation_loss.loss_mode == "k3"
        else:
            assert fn.func is ppo_loss and set(fn.keywords) == {"config"}
        assert fn.keywords["config"].clip_ratio == cfg.clip_ratio


def test_the_record_only_command_refuses_gigpo_in_one_line(tmp_path):
    with pytest.raises(EngineUnavailable, match=r"^verl_record_only=true runs verl's own sync trainer.*--adv grpo$"):
        verl_overrides(TrainConfig(out_dir=str(tmp_path), adv_estimator="gigpo", verl_record_only=True))


def test_the_dry_run_writes_the_switch(tmp_path):
    from tests.cli.test_engine_settings import _command_overrides, _icsd

    run = tmp_path / "run"
    r = _icsd("train", "--engine", "verl", "--dry-run", "--model", "tiny-random", "--adv", "grpo", "--out", str(run),
              "--set", "verl_record_only=true")
    assert r.returncode == 0, r.stderr
    ovr = _command_overrides(run / "verl_command.sh")
    assert "+icsd.record=true" in ovr and "trainer.v1.trainer_mode=sync" in ovr
    assert switch_settings(_compose(ovr)) == (True, f"{run}/dumps")
    bad = _icsd("train", "--engine", "trl", "--model", "tiny-random", "--adv", "grpo", "--out", str(tmp_path / "b"),
                "--set", "verl_record_only=true")
    assert bad.returncode == 2 and "verl_record_only=true writes a verl command; it needs --engine verl" in bad.stderr


@pytest.mark.parametrize("change,message", [
    (["trainer.use_v1=false"], "icsd.record=true needs verl's v1 trainer (trainer.use_v1=true); the legacy trainer "
                               "is not supported"),
    (["trainer.v1.trainer_mode=icsd_sync"], "icsd.record=true records verl's own loss; trainer_mode=icsd_sync writes "
                                            "its own dumps (+icsd.dump_dir) and is not recorded"),
    (["+icsd.allocator=icsd"], "icsd.record=true records verl's own loss and takes only +icsd.dump_dir; icsd "
                               "option(s) ['allocator'] configure trainer_mode=icsd_sync"),
    (["+icsd.record=1"], "icsd.record=1: give true or false"),
])
def test_the_switch_refuses_what_it_cannot_record_in_one_line(tmp_path, change, message):
    _, ovr = _record_only(tmp_path)
    if change[0].startswith("+icsd.record="):
        ovr = [o for o in ovr if not o.startswith("+icsd.record=")]
    c = _compose([*ovr, *change])
    with pytest.raises(ValueError) as e:
        switch_settings(c)
    assert str(e.value) == message


def test_without_the_switch_nothing_is_read():
    c = _compose(["trainer.use_v1=false"])  # even the legacy trainer: no icsd section, no refusal
    assert switch_settings(c) == (False, "")


class _WorkerGroup:
    def __init__(self):
        self.loss_fns = []

    def set_loss_fn(self, fn):
        self.loss_fns.append(fn)


def _v1_trainer(config):
    """An object with what verl's ``PPOTrainer.init`` touches: ``_setup`` builds the worker group."""
    t = SimpleNamespace(config=config, calls=[])

    def setup():
        t.calls.append("setup")
        t.actor_rollout_wg = _WorkerGroup()

    t._setup, t.on_init_end = setup, lambda: t.calls.append("on_init_end")
    return t


@pytest.mark.parametrize("distill", [False, True])
def test_the_switch_hands_the_workers_a_recording_of_their_own_loss(tmp_path, distill):
    import cloudpickle
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    register_switch()
    register_switch()  # once per process, however often the plug-in calls it
    _, ovr = _record_only(tmp_path, kl_coef=0.0)  # the test batch has no reference log-probs
    c = _compose([*ovr, *(DISTILL if distill else [])])
    t = _v1_trainer(c)
    PPOTrainer.init(t)
    assert t.calls == ["setup", "on_init_end"] and len(t.actor_rollout_wg.loss_fns) == 1
    # the loss travels to the Ray workers pickled (cloudpickle, as Ray sends it)
    rec = cloudpickle.loads(cloudpickle.dumps(t.actor_rollout_wg.loss_fns[0]))
    plain = worker_loss(c)
    assert rec.__wrapped__ is plain.func
    rows, values, td, out, n = _batch(3, teacher_layout="verl")
    want = plain(model_output=out, data=copy.deepcopy(td), dp_group=None)
    (g0,) = torch.autograd.grad(want[0], values)
    got = rec(model_output=out, data=copy.deepcopy(td), dp_group=None)
    (g1,) = torch.autograd.grad(got[0], values)
    _same(want, got)
    assert torch.equal(g0, g1)
    d = read_dump_flat(tmp_path / "run" / "dumps")
    assert len(d["logp"]) == n and (d["c"] == 1).all()

    off = _v1_trainer(_compose(["trainer.use_v1=true"]))  # no +icsd.record: verl's init alone
    PPOTrainer.init(off)
    assert off.calls == ["setup", "on_init_end"] and off.actor_rollout_wg.loss_fns == []


def test_the_legacy_trainer_refuses_the_switch_before_building_workers(tmp_path):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    refuse_legacy()
    _, ovr = _record_only(tmp_path)
    c = _compose([*ovr, "trainer.use_v1=false"])
    with pytest.raises(ValueError, match=r"^icsd\.record=true needs verl's v1 trainer \(trainer\.use_v1=true\); "
                                         r"the legacy trainer is not supported$"):
        RayPPOTrainer.init_workers(SimpleNamespace(config=c))
