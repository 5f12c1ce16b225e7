"""``icsd train --engine verl``: the run folder verl reads, the command that trains on it, and running it.

It writes ``config.json``, the environment's ``data/train.parquet`` and ``data/test.parquet``, ``model/`` for the
embedded or tiny model, ``agent_loops.yaml`` registering the ``icsd_env`` agent loop that plays the built-in
environment (:mod:`~icsd_audit.integrations.verl.env`) and ``verl_command.sh`` (``python -m
verl.trainer.main_ppo`` with the ``icsd_sync`` trainer and the run's settings, the advantage estimator included:
verl's ``grpo`` or our ``gigpo`` with the run's gamma, step weight and mode), then runs it in its own process group.
It needs NVIDIA GPUs and a rollout engine (vLLM or SGLang) and stops with one line (exit 2) before writing anything
when they are missing; ``dry_run`` writes everything on any machine and runs nothing.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

from icsd_audit.integrations.checks import EngineUnavailable
from icsd_audit.integrations.verl.env import AGENT_LOOP_NAME as AGENT_LOOP
from icsd_audit.outputs import GracefulStop, Stopped

__all__ = ["AGENT_LOOP", "CommandStopped", "GROUP_GRACE_S", "check_verl_batches", "verl_overrides",
           "write_verl_command", "prepare_verl", "run_command", "run_verl"]


def verl_overrides(cfg: Any, *, n_gpus: int = 1, nnodes: int = 1, data_dir: str | None = None,
                   model_path: str | None = None, agent_loop_config: str | None = None) -> list[str]:
    """Hydra overrides of verl's ``ppo_trainer`` config for an ICSD run with ``cfg``'s settings.

    ``data_dir`` holds ``train.parquet`` / ``test.parquet`` (default ``<out_dir>/data``),
    ``model_path`` the policy (default: ``cfg.model``, or ``<out_dir>/model`` where
    :func:`~.verl_env.export_model` puts ``embedded`` / ``tiny-random``) and
    ``agent_loop_config`` verl's agent-loop file (default ``<out_dir>/agent_loops.yaml``).
    """
    out = Path(cfg.out_dir)
    data = str(data_dir) if data_dir is not None else str(out / "data")
    if model_path is None:
        model_path = str(out / "model") if cfg.model in ("embedded", "tiny-random") else cfg.model
    loops = str(agent_loop_config) if agent_loop_config is not None else str(out / "agent_loops.yaml")
    mini = _mini_batch_prompts(cfg)
    record_only = bool(getattr(cfg, "verl_record_only", False))
    if record_only and cfg.adv_estimator == "gigpo":
        raise EngineUnavailable("verl_record_only=true runs verl's own sync trainer, which has no GiGPO (its anchors come "
                         "from icsd_sync): use --adv grpo")
    # the run's estimator: verl's grpo, or gigpo (registered by our plug-in, anchors from icsd_sync)
    if cfg.adv_estimator == "gigpo":
        adv = ["algorithm.adv_estimator=gigpo", f"algorithm.gamma={cfg.gamma}"]
        icsd_adv = [f"+icsd.step_weight={cfg.step_weight}", f"+icsd.gigpo_mode={cfg.gigpo_mode}"]
    else:
        adv = [f"algorithm.adv_estimator={cfg.adv_estimator}",
               f"algorithm.norm_adv_by_std_in_grpo={'true' if cfg.norm_adv_by_std else 'false'}"]
        icsd_adv = []
    if record_only:  # verl's own trainer and loss, recorded (icsd_audit.integrations.verl.record.register_switch)
        icsd = ["+icsd.record=true", f"+icsd.dump_dir={out}/dumps"]
    else:  # every allocator setting, from the one list (TrainConfig.allocation: AllocatorSettings' fields), and lambda
        icsd = [f"+icsd.distill_coef={cfg.effective_distill_coef}",
                *(f"+icsd.{k}={cfg.allocator if k == 'allocator' else v}" for k, v in cfg.allocation().to_dict().items()),
                f"+icsd.skillbank={cfg.skillbank_name}",
                f"+icsd.skill_mode={cfg.teacher_skill_mode}",  # skill_bank_mode='general': the general block only
                f"+icsd.dump_dir={out}/dumps", f"+icsd.alloc_scope={cfg.alloc_scope}", *icsd_adv]
    return [
        *adv,
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet",
        f"data.train_batch_size={cfg.n_tasks}", f"data.max_prompt_length={cfg.max_prompt_tokens}",
        # a row is a whole episode (replies + observations) in one context of at most max_prompt_tokens
        f"data.max_response_length={cfg.max_prompt_tokens}",
        f"actor_rollout_ref.model.path={model_path}",
        f"actor_rollout_ref.actor.optim.lr={cfg.lr}",
        f"actor_rollout_ref.actor.optim.lr_warmup_steps_ratio={cfg.lr_warmup_steps_ratio}",
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
        f"actor_rollout_ref.rollout.val_kwargs.temperature={cfg.eval_temperature}",
        f"actor_rollout_ref.rollout.val_kwargs.do_sample={'true' if cfg.eval_temperature > 0 else 'false'}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        # the environment: each data row is one episode of icsd_env (verl_agent_loop.EnvAgentLoop), whose
        # reward is the episode's shaped return minus the invalid-turn penalty (verl's reward manager is skipped)
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_LOOP}",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.use_v1=true", f"trainer.v1.trainer_mode={'sync' if record_only else 'icsd_sync'}",
        f"trainer.n_gpus_per_node={n_gpus}", f"trainer.nnodes={nnodes}",
        f"trainer.total_training_steps={cfg.total_steps}", f"trainer.default_local_dir={out}/checkpoints",
        "trainer.resume_mode=auto",  # running the command again continues from verl's newest checkpoint there
        f"trainer.test_freq={cfg.eval_every if cfg.eval_every > 0 else -1}", "trainer.val_before_train=false",
        f"trainer.logger=[{','.join(['console', *_report_to(cfg)])}]", "trainer.project_name=icsd",
        f"trainer.experiment_name={out.name}",
        *icsd,
    ]


def _mini_batch_prompts(cfg: Any) -> int:
    """verl's ``ppo_mini_batch_size`` of the run (in prompts)."""
    # verl counts mini-batches in prompts and one v1 row is a whole trajectory; a mini-batch
    # cannot exceed the step's prompts (one mini-batch per step: rho = 1, the allocation is exact)
    return max(1, min(cfg.n_tasks, cfg.mini_batch_rows // max(1, cfg.group_size)))


def check_verl_batches(cfg: Any, *, n_gpus: int, nnodes: int = 1) -> None:
    """Refuse batch sizes verl cannot split over ``n_gpus * nnodes`` ranks, naming the options that fix them.

    verl's ``validate_config`` needs a step's rows (``data.train_batch_size`` x
    ``rollout.n``) divisible by the GPU count, and its actor splits each mini-batch's rows
    (``ppo_mini_batch_size`` x ``rollout.n``) over the data-parallel ranks.
    """
    import math

    world, group = n_gpus * nnodes, cfg.group_size
    rows, mini = cfg.n_tasks * group, _mini_batch_prompts(cfg)
    if rows % world == 0 and (mini * group) % world == 0:
        return
    # the smallest fix: more tasks per step until a step splits, then mini-batches of more prompts until they do
    n_tasks = next(n for n in range(cfg.n_tasks, cfg.n_tasks * world + 1) if (n * group) % world == 0)
    m = next(k for k in range(min(mini, n_tasks), n_tasks + 1) if (k * group) % world == 0)
    fixes = [f"--set n_tasks={n_tasks} ({n_tasks * group} rows)"] if n_tasks != cfg.n_tasks else []
    if m != _mini_batch_prompts(cfg.replace(n_tasks=n_tasks)):
        fixes.append(f"--set mini_batch_rows={m * group} (mini-batches of {m} prompts)")
    g = math.gcd(rows, mini * group)
    gpus = [str(d // nnodes) for d in range(1, g + 1) if g % d == 0 and d % nnodes == 0]
    what = (f"a step's {rows} rows (n_tasks {cfg.n_tasks} x group_size {group})" if rows % world else
            f"a mini-batch's {mini * group} rows ({mini} prompt{'s' if mini > 1 else ''} x group_size {group})")
    alts = ", ".join(gpus[:-1]) + (" or " if len(gpus) > 1 else "") + gpus[-1] if gpus else ""
    raise EngineUnavailable(f"--gpus {n_gpus}: verl splits {what} evenly over {world} GPU(s); fix: "
                            + " and ".join(fixes) + (f", or --gpus {alts}" if alts else ""))


def _report_to(cfg: Any) -> tuple[str, ...]:
    """``--report-to`` trackers (verl's ``trainer.logger`` backends of the same names carry the icsd/ metrics)."""
    from icsd_audit.runs.trackers import parse_report_to

    return parse_report_to(getattr(cfg, "report_to", None))


def _gpu_guard(n_gpus: int) -> str:
    """A first line for the command: without ``n_gpus`` CUDA devices it stops in one line, exit 2, before Ray."""
    code = ("import sys, torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; "
            f"sys.exit(0) if n >= {n_gpus} else (print('error: this verl run needs {n_gpus} NVIDIA GPU(s) and torch "
            "sees %d; see docs/engines.md' % n, file=sys.stderr), sys.exit(2))")
    return f"python -c {shlex.quote(code)}"


def write_verl_command(cfg: Any, *, n_gpus: int = 1, **paths: Any) -> Path:
    """Write ``<out_dir>/verl_command.sh`` (atomically) and return its path (``paths``: :func:`verl_overrides`'s)."""
    import os
    import tempfile

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["#!/usr/bin/env bash", "# written by `icsd train --engine verl` (docs/engines.md)", "set -euo pipefail",
             _gpu_guard(n_gpus)]
    # --report-to: verl's trackers write into the run folder unless the environment says otherwise
    stores = {"tensorboard": ("TENSORBOARD_DIR", out.resolve() / "tensorboard"),
              "mlflow": ("MLFLOW_TRACKING_URI", f"sqlite:///{out.resolve() / 'mlflow.db'}"),
              "wandb": ("WANDB_MODE", "offline")}
    lines += [f'export {var}="${{{var}:-{val}}}"' for name, (var, val) in stores.items() if name in _report_to(cfg)]
    lines += ["python -m verl.trainer.main_ppo \\"]
    ovr = verl_overrides(cfg, n_gpus=n_gpus, **paths)
    lines += [f"    {shlex.quote(o)} \\" for o in ovr[:-1]] + [f"    {shlex.quote(ovr[-1])}", ""]
    path = out / "verl_command.sh"
    fd, tmp = tempfile.mkstemp(prefix=".verl_command.", dir=out)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines))
    from icsd_audit.outputs import umask_mode

    umask_mode(tmp, executable=True)
    os.replace(tmp, path)
    return path


def _verl_requirements() -> tuple[int, str | None]:
    """(GPU count, what is missing or None)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("verl") is None:
        return 0, "needs verl: pip install 'icsd-audit[verl]'"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return 0, ("needs NVIDIA GPUs (torch sees none) and a rollout engine (pip install vllm); "
                   "--dry-run writes the data files and the command without them")
    if importlib.util.find_spec("vllm") is None and importlib.util.find_spec("sglang") is None:
        return n, "needs a rollout engine for verl: pip install vllm (or sglang)"
    return n, None


def prepare_verl(cfg: Any, *, n_gpus: int) -> Path:
    """Write everything the verl run reads into the run folder and return the command file.

    ``config.json`` (the run's settings, which the agent loop plays by), ``data/train.parquet``
    and ``data/test.parquet`` (:func:`~.verl_env.write_verl_data`), ``model/`` for
    ``embedded`` / ``tiny-random`` (:func:`~.verl_env.export_model`), ``agent_loops.yaml`` and
    ``verl_command.sh``.
    """
    from icsd_audit.integrations.verl.env import export_model, write_agent_loop_config, write_verl_data

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = cfg.save(out / "config.json")
    write_verl_data(cfg, out / "data")
    model_path = export_model(cfg.model, out, seed=cfg.seed)
    loops = write_agent_loop_config(config, out / "agent_loops.yaml")
    return write_verl_command(cfg, n_gpus=n_gpus, data_dir=str((out / "data").resolve()), model_path=model_path,
                              agent_loop_config=str(loops.resolve()))


def run_verl(cfg: Any, *, dry_run: bool = False, n_gpus: int | None = None, overwrite: bool = False) -> Path:
    """Check the machine (unless ``dry_run``) and the run folder, write it (:func:`prepare_verl`), run the command.

    Without verl, GPUs or a rollout engine it stops with one line before writing anything or
    starting Ray; ``dry_run`` writes everything on any machine and runs nothing.  The run
    folder follows the built-in loop's rule: one run per folder, ``overwrite`` moves an
    earlier one aside.
    """
    from icsd_audit.train.run.folder import check_run_folder, open_run_folder

    if cfg.lora_enabled or cfg.init:  # the command would silently train the full model from --model
        raise EngineUnavailable("icsd train --engine verl does not pass --lora / --init to verl; set verl's "
                                "actor_rollout_ref.model.lora_rank in the written command yourself, or use "
                                "--engine builtin or trl")
    n = 0
    if not dry_run:
        n, missing = _verl_requirements()
        if missing:
            raise EngineUnavailable(f"icsd train --engine verl {missing}")
    gpus = n_gpus or max(n, 1)
    check_verl_batches(cfg, n_gpus=gpus)
    check_run_folder(cfg.out_dir, resume=False, overwrite=overwrite)
    with open_run_folder(cfg.out_dir, resume=False, overwrite=overwrite):
        path = prepare_verl(cfg, n_gpus=gpus)
        if dry_run:
            return path
        from icsd_audit.runs.manifest import RunManifest

        manifest = RunManifest(cfg.out_dir, config=cfg.to_dict(), engine="verl", seed=cfg.seed,
                               total_steps=cfg.total_steps).start()
        try:
            rc = run_command(path)
        except CommandStopped as exc:
            manifest.finish(f"stopped by {exc.signal_name}")
            raise
        if rc != 0:
            raise EngineUnavailable(f"{path} exited with code {rc} (verl's output is above)")
        manifest.step(cfg.total_steps)  # verl returned success: every step ran (it logs them itself)
        manifest.finish()
    return path


class CommandStopped(Stopped):
    """A written engine command (``verl_command.sh``) stopped by SIGTERM or SIGINT sent to ``icsd train``."""

    def __init__(self, signum: int, *, command: Path):
        self.command = command
        super().__init__(signum)
        self.args = (self.line(),)

    def line(self, resume_command: str | None = None) -> str:
        return (f"stopped by {self.signal_name}: verl got the signal and has exited; its checkpoints are in "
                f"{self.command.parent / 'checkpoints'}; continue with: bash {self.command} (trainer.resume_mode=auto "
                "continues from verl's newest checkpoint there)")


def run_command(path: Path) -> int:
    """Run ``bash path`` and return its exit code; SIGTERM / SIGINT to this process reach the command.

    The command runs in its own process group (verl's driver, Ray and the workers it starts
    from the shell). A first signal is passed to that group and the command is waited for,
    so nothing of it writes into the run folder after this process lets the folder go; a
    second signal kills the group. Then :class:`CommandStopped` (exit code 143 / 130).
    """
    import contextlib
    import os
    import signal

    def tell(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # the group has already exited: nothing to tell
            os.killpg(proc.pid, sig)

    with GracefulStop():
        proc = subprocess.Popen(["bash", str(path)], start_new_session=True)
        try:
            return proc.wait()
        except Stopped as exc:
            tell(exc.signum)
            try:
                proc.wait()
                # the shell can end before the jobs it started (verl's driver, Ray): they get the same
                # grace, then the group is killed, so nothing of the command runs once we return
                if not _group_ended(proc.pid, timeout=GROUP_GRACE_S):
                    tell(signal.SIGKILL)
            except Stopped:  # the user insists
                tell(signal.SIGKILL)
                proc.wait()
            _group_ended(proc.pid, timeout=5.0)
            raise CommandStopped(exc.signum, command=path) from None


#: seconds a stopped command's remaining processes get to exit after its shell has ended, before SIGKILL
GROUP_GRACE_S = 30.0


def _group_ended(pgid: int, *, timeout: float) -> bool:
    """Whether process group ``pgid`` has no running member within ``timeout`` seconds.

    Zombies do not count: they run nothing, and reaping them is their new parent's job
    (in a container whose init never reaps, they stay).  Without ``/proc`` the group
    cannot be inspected and counts as ended.
    """
    import time

    deadline = time.monotonic() + timeout
    while _running_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _running_members(pgid: int) -> list[int]:
    """The pids of ``pgid``'s members that are not zombies (``/proc/PID/stat``: state, ppid, pgrp after the name)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    pids = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # the process ended while we looked
            continue
        if int(pgrp) == pgid and state not in ("Z", "X"):
            pids.append(int(stat.parent.name))
    return pids
