"""``icsd train --engine builtin|trl|verl``: one run config, three engines.

* ``builtin`` -- :func:`icsd_audit.train.loop.train` (multi-turn, our rollouts).
* ``trl`` -- :class:`~icsd_audit.integrations.trl.ICSDGRPOTrainer` on the same model,
  allocator, lambda, seed, learning rate and step count.  TRL's ``GRPOTrainer`` samples
  one completion per prompt, so each episode is the environment's *first turn*: the
  dataset is the student prompt of every training task's first observation, the reward
  is the environment's reward for the parsed action (shaped like the built-in run's
  ``invalid_penalty``).  Multi-turn agents need ``builtin`` or ``verl``.
* ``verl`` -- writes ``verl_command.sh`` (``python -m verl.trainer.main_ppo`` with the
  ``icsd_sync`` trainer and the run's settings, the advantage estimator included: verl's
  ``grpo`` or our ``gigpo`` with the run's gamma, step weight and mode; the run's
  ``invalid_penalty`` has no verl counterpart, since verl rows carry no per-turn validity)
  into the run folder and runs it; it needs NVIDIA GPUs and a rollout engine (vLLM or
  SGLang), and stops with one line (exit 2) when they are missing.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["ENGINES", "EngineUnavailable", "verl_overrides", "write_verl_command", "run_verl", "run_trl"]

ENGINES = ("builtin", "trl", "verl")


class EngineUnavailable(ValueError):
    """The engine cannot run here (missing package or hardware); the message says what it needs."""


def verl_overrides(cfg: Any, *, n_gpus: int = 1, nnodes: int = 1, data_dir: str = "data/webshop") -> list[str]:
    """Hydra overrides of verl's ``ppo_trainer`` config for an ICSD run with ``cfg``'s settings."""
    model = cfg.model if cfg.model not in ("embedded", "tiny-random") else "Qwen/Qwen2.5-1.5B-Instruct"
    # verl counts mini-batches in prompts and one v1 row is a whole trajectory; a mini-batch
    # cannot exceed the step's prompts (one mini-batch per step: rho = 1, the allocation is exact)
    mini = max(1, min(cfg.n_tasks, cfg.mini_batch_rows // max(1, cfg.group_size)))
    # the run's estimator: verl's grpo, or gigpo (registered by our plug-in, anchors from icsd_sync)
    if cfg.adv_estimator == "gigpo":
        adv = ["algorithm.adv_estimator=gigpo", f"algorithm.gamma={cfg.gamma}"]
        icsd_adv = [f"+icsd.step_weight={cfg.step_weight}", f"+icsd.gigpo_mode={cfg.gigpo_mode}"]
    else:
        adv = [f"algorithm.adv_estimator={cfg.adv_estimator}",
               f"algorithm.norm_adv_by_std_in_grpo={'true' if cfg.norm_adv_by_std else 'false'}"]
        icsd_adv = []
    return [
        *adv,
        f"data.train_files={data_dir}/train.parquet", f"data.val_files={data_dir}/test.parquet",
        f"data.train_batch_size={cfg.n_tasks}", f"data.max_prompt_length={cfg.max_prompt_tokens}",
        f"data.max_response_length={cfg.max_response_tokens}",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.actor.optim.lr={cfg.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.shuffle=false",
        f"actor_rollout_ref.actor.ppo_epochs={cfg.ppo_epochs}",
        f"actor_rollout_ref.actor.clip_ratio={cfg.clip_ratio}", f"actor_rollout_ref.actor.clip_ratio_c={cfg.dual_clip}",
        f"actor_rollout_ref.actor.use_kl_loss={'true' if cfg.kl_coef > 0 else 'false'}",
        f"actor_rollout_ref.actor.kl_loss_coef={cfg.kl_coef}", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={cfg.group_size}",
        f"actor_rollout_ref.rollout.temperature={cfg.temperature}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.use_v1=true", "trainer.v1.trainer_mode=icsd_sync",
        f"trainer.n_gpus_per_node={n_gpus}", f"trainer.nnodes={nnodes}",
        f"trainer.total_training_steps={cfg.total_steps}", f"trainer.default_local_dir={cfg.out_dir}/checkpoints",
        "trainer.logger=[console]", f"trainer.project_name=icsd", f"trainer.experiment_name={Path(cfg.out_dir).name}",
        f"+icsd.distill_coef={cfg.effective_distill_coef}", f"+icsd.allocator={cfg.allocator}",
        f"+icsd.trust={cfg.trust}", f"+icsd.min_group={cfg.min_group}", f"+icsd.eps={cfg.alloc_eps}",
        f"+icsd.seed={cfg.alloc_seed}", f"+icsd.skillbank={cfg.skillbank_name}", f"+icsd.skill_mode={cfg.skill_mode}",
        f"+icsd.dump_dir={cfg.out_dir}/dumps", *icsd_adv,
    ]


def write_verl_command(cfg: Any, *, n_gpus: int = 1) -> Path:
    """Write ``<out_dir>/verl_command.sh`` (atomically) and return its path."""
    import os
    import tempfile

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["#!/usr/bin/env bash", "# written by `icsd train --engine verl` (docs/engines.md)", "set -euo pipefail",
             "python -m verl.trainer.main_ppo \\"]
    ovr = verl_overrides(cfg, n_gpus=n_gpus)
    lines += [f"    {shlex.quote(o)} \\" for o in ovr[:-1]] + [f"    {shlex.quote(ovr[-1])}", ""]
    path = out / "verl_command.sh"
    fd, tmp = tempfile.mkstemp(prefix=".verl_command.", dir=out)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines))
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


def _verl_requirements() -> tuple[int, str | None]:
    """(GPU count, what is missing or None)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("verl") is None:
        return 0, "needs verl: pip install 'icsd[verl]'"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return 0, ("needs NVIDIA GPUs (torch sees none) and a rollout engine (pip install vllm); "
                   "on this machine use --engine builtin or --engine trl")
    if importlib.util.find_spec("vllm") is None and importlib.util.find_spec("sglang") is None:
        return n, "needs a rollout engine for verl: pip install vllm (or sglang)"
    return n, None


def run_verl(cfg: Any) -> Path:
    """Check the machine, write the command, run it; returns the command file."""
    n, missing = _verl_requirements()
    if missing:
        raise EngineUnavailable(f"icsd train --engine verl {missing}")
    path = write_verl_command(cfg, n_gpus=n)
    subprocess.run(["bash", str(path)], check=True)
    return path


def run_trl(cfg: Any, *, max_steps: int | None = None) -> Path:
    """Train ``cfg`` with ``ICSDGRPOTrainer`` on first-turn episodes; returns the dumps folder."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise EngineUnavailable("icsd train --engine trl needs TRL: pip install 'icsd[trl]'")
    import datasets
    import torch
    from trl import GRPOConfig

    from icsd_audit.envs.base import parse_action
    from icsd_audit.integrations.trl import ICSDConfig, ICSDGRPOTrainer, skill_teacher_prompt
    from icsd_audit.train.loop import _default_env_factory, load_policy
    from icsd_audit.train.prompts import TurnContext
    from icsd_audit.train.rollout import PromptBuilder
    from icsd_audit.train.skills import load_skillbank

    out = Path(cfg.out_dir)
    dev = torch.device("cpu") if cfg.device in ("auto", "cpu") and not torch.cuda.is_available() else torch.device(
        "cuda" if cfg.device == "auto" else cfg.device)
    model, tok = load_policy(cfg.model, device=dev, seed=cfg.seed)
    env = _default_env_factory(cfg)("train")
    builder = PromptBuilder(tok, env=cfg.env, history_window=cfg.history_window, max_prompt_tokens=cfg.max_prompt_tokens,
                            system_prompt=cfg.system_prompt, one_shot=cfg.one_shot, skill_placement="prefix")
    rows = []
    for task in range(min(env.num_tasks, max(cfg.n_tasks * 4, 8))):
        obs = env.reset(task)
        ctx = TurnContext(task=obs.instruction, observation=obs.text, actions=obs.available_actions, env=cfg.env)
        rows.append({"prompt": builder.student_text(ctx), "task": task, "instruction": obs.instruction})

    def reward(completions: list[str], task: list[int], **_: Any) -> list[float]:
        out_r = []
        for text, t in zip(completions, task):
            obs = env.reset(int(t))
            act = parse_action(text, obs.available_actions, require_think=cfg.require_think)
            out_r.append(env.step(act.action).reward if act.valid else -cfg.invalid_penalty)
        return out_r

    args = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=cfg.n_tasks * cfg.group_size,
                      num_generations=cfg.group_size, max_completion_length=cfg.max_response_tokens,
                      max_steps=max_steps or cfg.total_steps, learning_rate=cfg.lr, beta=cfg.kl_coef,
                      epsilon=cfg.clip_ratio, temperature=cfg.temperature, seed=cfg.seed, use_cpu=dev.type == "cpu",
                      bf16=False, report_to=[], logging_steps=1, save_strategy="no", dataloader_num_workers=0)
    policy: Any = model
    if cfg.kl_coef > 0:  # TRL builds its reference model from a path: hand it a local copy of the policy
        policy = str(out / "trl" / "initial_policy")
        model.save_pretrained(policy)
        tok.save_pretrained(policy)
    icsd = ICSDConfig(distill_coef=cfg.effective_distill_coef, allocator=cfg.allocator, trust=cfg.trust,
                      min_group=cfg.min_group, eps=cfg.alloc_eps, seed=cfg.alloc_seed, dump_dir=str(out / "dumps"))
    trainer = ICSDGRPOTrainer(model=policy, processing_class=tok, reward_funcs=reward, args=args,
                              train_dataset=datasets.Dataset.from_list(rows), icsd=icsd,
                              teacher_prompt=skill_teacher_prompt(load_skillbank(cfg.skillbank_name),
                                                                  task_key="instruction", mode=cfg.skill_mode))
    trainer.train()
    print(f"done: trl run in {out}; dumps {out / 'dumps'}", file=sys.stderr)
    return out / "dumps"
