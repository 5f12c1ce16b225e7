"""The actor's learning-rate warm-up (verl's constant schedule with warm-up): values by hand, the
actor applying them, and the engines carrying the setting."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from icsd_audit.train.config import ConfigError, TrainConfig, preset
from icsd_audit.train.update.schedule import warmup_lr, warmup_steps


def test_warmup_values_by_hand():
    # paper-searchqa: 200 steps, ratio 0.1 -> int(20.0) = 20 warm-up steps; step s runs at 1e-6 * s / 20
    assert warmup_steps(200, 0.1) == 20
    by_hand = {0: 0.0, 1: 5e-8, 10: 5e-7, 19: 9.5e-7, 20: 1e-6, 21: 1e-6, 199: 1e-6}
    for s, want in by_hand.items():
        assert warmup_lr(s, lr=1e-6, total_steps=200, ratio=0.1) == pytest.approx(want, rel=1e-12, abs=0), s
    # verl truncates: int(0.1 * 15) = 1 (step 0 at 0, then lr); int(0.1 * 7) = 0 (no warm-up at all)
    assert [warmup_lr(s, lr=2.0, total_steps=15, ratio=0.1) for s in range(3)] == [0.0, 2.0, 2.0]
    assert [warmup_lr(s, lr=2.0, total_steps=7, ratio=0.1) for s in range(3)] == [2.0, 2.0, 2.0]
    # ratio 0: the configured rate itself at every step (a run without warm-up is unchanged)
    assert all(warmup_lr(s, lr=1e-5, total_steps=3, ratio=0.0) == 1e-5 for s in range(3))
    # ratio 1: the whole run warms up, the last step at lr * (T - 1) / T
    assert warmup_lr(3, lr=1.0, total_steps=4, ratio=1.0) == 0.75


def test_hf_constant_with_warmup_has_the_same_factor():
    """The TRL engine passes warmup_steps to HF's constant_with_warmup: same rates, optimizer step by step."""
    from transformers import get_constant_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
    sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=warmup_steps(200, 0.1))
    for s in range(30):
        assert opt.param_groups[0]["lr"] == pytest.approx(warmup_lr(s, lr=1e-6, total_steps=200, ratio=0.1), abs=1e-20)
        opt.step()
        sched.step()


def test_ratio_is_validated():
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="lr_warmup_steps_ratio"):
            TrainConfig(lr_warmup_steps_ratio=bad).validate()


def test_presets_set_it_where_sdar_does():
    assert preset("paper-searchqa").lr_warmup_steps_ratio == 0.1
    for name in ("paper", "paper-alfworld", "cpu-demo", "cpu-demo-searchqa"):
        assert preset(name).lr_warmup_steps_ratio == 0.0, name


@pytest.fixture(scope="module")
def tiny():
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    return tiny_random_causal_lm(seed=3, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)


def _update(model, tok, *, lr: float, schedule=None, step: int = 0):
    from icsd_audit.train.update.actor import Actor, NoDistillation, StepData
    from icsd_audit.train.update.logprobs import score_rows

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (6,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(3, 250, (4,), generator=g).tolist() for _ in range(4)]
    old = score_rows(model, prompts, responses, [list(range(4))], pad_id=tok.pad_token_id,
                     device=torch.device("cpu"), temperature=1.0)
    data = StepData(prompts=prompts, responses=responses, old_logp=[old[i] for i in range(4)],
                    advantage=torch.tensor([1.0, -1.0, 0.5, -0.5]), traj=torch.arange(4) // 2, turn=torch.zeros(4, dtype=torch.long),
                    teacher_logp=None, ref_logp=None)
    actor = Actor(model, torch.optim.SGD(model.parameters(), lr=lr), distill=NoDistillation(), clip_ratio=0.2,
                  dual_clip=3.0, kl_coef=0.0, temperature=1.0, mini_batch_rows=2, micro_batch_rows=2, ppo_epochs=1,
                  grad_clip=1e9, skip_first_prepass=True, shuffle_rows=False, seed=0, pad_id=tok.pad_token_id,
                  device=torch.device("cpu"), lr_schedule=schedule)
    metrics, _, _ = actor.update(step, data)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), metrics


def test_actor_runs_every_optimizer_step_of_a_training_step_at_its_rate(tiny):
    model, tok = tiny
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    # step 0 of a warm-up: rate 0, both mini-batches leave the weights as they were
    after, m = _update(copy.deepcopy(model), tok, lr=0.1, schedule=lambda s: warmup_lr(s, lr=0.1, total_steps=10, ratio=0.5))
    assert m["lr"] == 0.0 and torch.equal(after, before)
    # step 2 of 5 warm-up steps: 0.1 * 2 / 5 = 0.04 for both mini-batches, as an optimizer built with 0.04
    sched, _ = _update(copy.deepcopy(model), tok, lr=0.1, step=2,
                       schedule=lambda s: warmup_lr(s, lr=0.1, total_steps=10, ratio=0.5))
    plain, m_plain = _update(copy.deepcopy(model), tok, lr=0.04, step=2)
    assert torch.equal(sched, plain) and not torch.equal(plain, before) and m_plain["lr"] == 0.04


def test_engines_carry_the_ratio():
    from icsd_audit.integrations.verl.launch import verl_overrides

    cfg = preset("paper-searchqa")
    over = verl_overrides(cfg, data_dir="/d", model_path="/m", agent_loop_config="/a.yaml")
    assert "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1" in over
    assert "actor_rollout_ref.rollout.val_kwargs.temperature=0.0" in over
    assert "actor_rollout_ref.rollout.val_kwargs.do_sample=false" in over


def test_the_trainer_logs_and_uses_the_warmup(tmp_path):
    """3 steps with ratio 0.7: int(2.1) = 2 warm-up steps, so actor/lr is 0, lr / 2, lr (by hand)."""
    from icsd_audit.train.loop import train

    cfg = TrainConfig(model="tiny-random", device="cpu", precision="float32", out_dir=str(tmp_path / "run"), threads=1,
                      n_tasks=1, group_size=2, max_turns=1, history_window=1, max_prompt_tokens=256,
                      max_response_tokens=4, rollout_batch_rows=8, mini_batch_rows=4, micro_batch_rows=2, lr=1e-3,
                      total_steps=3, dump_every=0, checkpoint_every=0, eval_every=0, allocator="none", kl_coef=0.0,
                      adv_estimator="grpo", lr_warmup_steps_ratio=0.7)
    res = train(cfg)
    lrs = [json.loads(line)["actor/lr"] for line in res.metrics_path.read_text().splitlines()]
    assert lrs == [0.0, 0.0005, 0.001]


@pytest.mark.engines
def test_the_trl_engine_runs_the_same_schedule(tmp_path):
    """--engine trl with ratio 0.7 over 3 steps: TRL's logged rate is 0, lr / 2, lr as in the built-in loop."""
    pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    sets = ["n_tasks=2", "group_size=2", "max_turns=2", "max_response_tokens=8", "max_prompt_tokens=3000",
            "one_shot=false", "lr_warmup_steps_ratio=0.7", "total_steps=3"]
    r = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "train", "--engine", "trl", "--preset", "cpu-demo",
                        "--model", "tiny-random", "--adv", "grpo", "--steps", "3", "--out", str(run),
                        *[a for s in sets for a in ("--set", s)]],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "ICSD_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    lr = preset("cpu-demo").lr
    got = [json.loads(x)["trl/learning_rate"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert got == pytest.approx([0.0, lr / 2, lr], abs=1e-15)
