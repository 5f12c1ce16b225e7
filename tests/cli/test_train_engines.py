"""`icsd train --engine ...`: engine choice, the verl command, and the one-line stop without GPUs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from icsd_audit.integrations.engines import verl_overrides, write_verl_command
from icsd_audit.train.config import TrainConfig


def _icsd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True, timeout=300)


def test_unknown_engine_is_one_line_exit_2():
    r = _icsd("train", "--engine", "megatron", "--preset", "cpu-demo")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --engine 'megatron': choose one of builtin, trl, verl"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the stop on a machine without GPUs")
def test_verl_without_gpus_stops_with_one_line(tmp_path):
    r = _icsd("train", "--engine", "verl", "--preset", "cpu-demo", "--out", str(tmp_path / "run"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: icsd train --engine verl needs ")
    assert "Traceback" not in r.stderr


def test_verl_command_carries_the_run_settings(tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), allocator="sdar", distill_coef=0.02, group_size=8, n_tasks=16,
                      mini_batch_rows=512, model="/models/qwen")
    ovr = verl_overrides(cfg, n_gpus=4)
    assert "trainer.v1.trainer_mode=icsd_sync" in ovr and "actor_rollout_ref.actor.shuffle=false" in ovr
    assert "+icsd.allocator=sdar" in ovr and "+icsd.distill_coef=0.02" in ovr
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=16" in ovr  # 512 rows / 8 rollouts, capped at 16 prompts
    cfg2 = TrainConfig(out_dir=str(tmp_path / "r2"), group_size=8, n_tasks=128, mini_batch_rows=512)
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=64" in verl_overrides(cfg2)
    assert "trainer.n_gpus_per_node=4" in ovr and "actor_rollout_ref.model.path=/models/qwen" in ovr
    assert ovr[:2] == ["algorithm.adv_estimator=gigpo", "algorithm.gamma=0.95"]  # TrainConfig's default estimator
    assert ovr[-2:] == ["+icsd.step_weight=1.0", "+icsd.gigpo_mode=mean_norm"]
    grpo = verl_overrides(TrainConfig(out_dir=str(tmp_path / "r3"), adv_estimator="grpo", norm_adv_by_std=False))
    assert grpo[:2] == ["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false"]
    assert not any("gamma" in o or "step_weight" in o or "gigpo" in o for o in grpo)
    path = write_verl_command(cfg, n_gpus=4)
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "python -m verl.trainer.main_ppo \\" in text
    assert [p.name for p in path.parent.iterdir()] == ["verl_command.sh"]  # no temporary left behind


@pytest.mark.engines
def test_verl_overrides_are_valid_for_verls_config(tmp_path):
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd[verl]'")
    import os

    from hydra import compose, initialize_config_dir
    import verl

    from icsd_audit.integrations.verl_trainer import ICSDVerlConfig

    d = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    for est, extra in (("gigpo", dict(gamma=0.9, step_weight=0.4, gigpo_mode="mean_std_norm")), ("grpo", {})):
        cfg = TrainConfig(out_dir=str(tmp_path / est), model="/models/qwen", adv_estimator=est, **extra)
        ovr = [o for o in verl_overrides(cfg) if not o.startswith("data.") or "batch_size" in o or "length" in o]
        with initialize_config_dir(config_dir=d, version_base=None):
            c = compose(config_name="ppo_trainer", overrides=ovr)
        assert c.trainer.v1.trainer_mode == "icsd_sync" and c.icsd.skillbank == "webshop"
        assert c.algorithm.adv_estimator == est
        icsd = ICSDVerlConfig.from_config(c.icsd)  # every +icsd option is one the trainer knows
        if est == "gigpo":
            assert c.algorithm.gamma == 0.9 and (icsd.step_weight, icsd.gigpo_mode) == (0.4, "mean_std_norm")
        else:
            assert c.algorithm.gamma == 1.0 and c.algorithm.norm_adv_by_std_in_grpo is True
