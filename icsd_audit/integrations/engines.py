"""``icsd train --engine builtin|trl|verl``: one run config, three engines.

* ``builtin`` -- :func:`icsd_audit.train.loop.train` (multi-turn, our rollouts).
* ``trl`` -- :class:`~icsd_audit.integrations.trl.trainer.ICSDGRPOTrainer` on the same model,
  allocator, lambda, seed, learning rate, step count, group size and tasks per step
  (the built-in loop's draw), with whole multi-turn episodes from
  :class:`~icsd_audit.integrations.trl.rollout.EpisodeRollout` as TRL's ``rollout_func``:
  one TRL row per episode (first student prompt; replies and observations as one
  conversation, observations masked out), turns judged and rewards shaped by the built-in
  loop's code.  TRL runs GRPO: the advantage is per episode, and ``adv_estimator='gigpo'``
  stops with one line (exit 2).  What differs from ``builtin`` is in docs/engines.md.
* ``verl`` -- writes the run folder verl reads (``config.json``, the environment's
  ``data/train.parquet`` and ``data/test.parquet``, ``model/`` for the embedded or tiny
  model, ``agent_loops.yaml`` registering the ``icsd_env`` agent loop that plays the
  built-in environment, :mod:`.verl_env`) and ``verl_command.sh`` (``python -m
  verl.trainer.main_ppo`` with the ``icsd_sync`` trainer and the run's settings, the
  advantage estimator included: verl's ``grpo`` or our ``gigpo`` with the run's gamma,
  step weight and mode), then runs it.  It needs NVIDIA GPUs and a rollout engine (vLLM or
  SGLang) and stops with one line (exit 2) before writing anything when they are
  missing; ``dry_run`` writes everything on any machine and runs nothing.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from icsd_audit.integrations.verl.env import AGENT_LOOP_NAME as AGENT_LOOP
from icsd_audit.outputs import GracefulStop, Stopped

__all__ = ["ENGINES", "AGENT_LOOP", "EngineUnavailable", "CommandStopped", "verl_overrides", "write_verl_command",
           "prepare_verl", "run_command", "run_verl", "run_trl"]

ENGINES = ("builtin", "trl", "verl")


class EngineUnavailable(ValueError):
    """The engine cannot run here (missing package or hardware); the message says what it needs."""


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


#: the one line ``icsd train --engine trl`` prints when it replaces the preset's GiGPO
TRL_GRPO_LINE = ("icsd train --engine trl: GRPO advantages (one per episode; TRL has no GiGPO) instead of the "
                 "preset's adv_estimator={est!r}")


def _trl_policy(cfg: Any, dev: Any) -> tuple[Any, Any, Any]:
    """(model, tokenizer, peft_config) for TRL, with the built-in loop's LoRA semantics.

    A fresh adapter goes to TRL as ``peft_config``: TRL wraps the model and scores its
    reference with the adapter disabled (the base). A run from an adapter (``init``) hands
    TRL the adapter model itself: TRL then copies the adapter into a frozen ``ref`` adapter
    and scores its reference with it, the initial policy as on the built-in loop.
    """
    from icsd_audit.train.models.loading import load_policy

    if not cfg.lora_enabled:
        model, tok = load_policy(cfg.init_path or cfg.model, device=dev, seed=cfg.seed,
                                 trust_remote_code=cfg.trust_remote_code)
        return model, tok, None
    from icsd_audit.train.models import lora as lo

    init_adapter = cfg.init_path if cfg.init is not None and lo.is_adapter_dir(str(cfg.init_path)) else None
    if init_adapter is not None:
        base_ref, base_seed = lo.base_of(init_adapter, cfg.model, cfg.seed)
        base, tok = load_policy(base_ref, device=dev, seed=base_seed, trust_remote_code=cfg.trust_remote_code)
        return lo.load_adapter(base, init_adapter, trainable=True), tok, None
    model, tok = load_policy(cfg.init_path or cfg.model, device=dev, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    settings = lo.LoraSettings(rank=cfg.lora_rank, alpha=cfg.lora_alpha or 2.0 * cfg.lora_rank, targets=cfg.lora_targets)
    return model, tok, settings.peft_config()


def run_trl(cfg: Any, *, max_steps: int | None = None, reporter: Any = None, adv_explicit: bool = False,
            overwrite: bool = False, resume: str | Path | bool | None = None) -> Path:
    """Train ``cfg`` with ``ICSDGRPOTrainer`` on whole episodes (:mod:`.trl_rollout`) into the run folder.

    Checks in this order, before anything is written: TRL installed; the estimator (TRL runs
    GRPO: a preset's ``gigpo`` becomes ``grpo`` with one line on stderr, an explicit
    ``adv_explicit`` one stops with one line); the run folder and the checkpoint a ``resume``
    continues from (:func:`~icsd_audit.train.run.resume.plan_run`, the built-in loop's rules:
    one run per folder, ``overwrite`` moves an old run aside). Then, holding the folder's lock:
    ``config.json``, ``metrics.jsonl``, ``checkpoints/`` and ``dumps/`` as the built-in loop
    writes them, each step committed whole, with its progress lines on ``reporter``
    (:mod:`.trl_run`). ``resume`` (``True``: the newest complete checkpoint; or a checkpoint
    folder) continues a run: the steps after the checkpoint are redone, their dumps and
    metrics replaced. SIGTERM and SIGINT stop it as they stop the built-in loop: the step in
    progress publishes nothing and :class:`~icsd_audit.train.run.resume.TrainingStopped` (exit
    code 143 / 130) says what is complete and how to continue. Returns the run folder.
    """
    import contextlib
    import importlib.util

    from icsd_audit.train.run.checkpoint import latest_checkpoint
    from icsd_audit.train.run.metrics import NullReporter
    from icsd_audit.train.run.resume import Progress, TrainingStopped, plan_run

    if importlib.util.find_spec("trl") is None:
        raise EngineUnavailable("icsd train --engine trl needs TRL: pip install 'icsd-audit[trl]'")
    if cfg.distill_enabled and cfg.alloc_scope != "mini-batch":  # the dumps would say mini-batch
        raise EngineUnavailable(f"icsd train --engine trl allocates once per generation batch (one optimizer step), "
                                f"not alloc_scope={cfg.alloc_scope!r}: drop it, or use --engine builtin or verl")
    if cfg.adv_estimator != "grpo":
        if adv_explicit:
            raise EngineUnavailable(f"icsd train --engine trl runs GRPO (one advantage per episode), not "
                                    f"adv_estimator={cfg.adv_estimator!r}: pass --adv grpo, or use --engine builtin "
                                    "or verl for GiGPO")
        print(TRL_GRPO_LINE.format(est=cfg.adv_estimator), file=sys.stderr)
        cfg = cfg.replace(adv_estimator="grpo")
    reporter = reporter if reporter is not None else NullReporter()
    plan = plan_run(cfg, resume=resume, overwrite=overwrite)
    if plan.state is not None and plan.state.get("engine") != "trl":
        raise EngineUnavailable(f"--resume: {plan.checkpoint} was not written by --engine trl (its optimizer and "
                                "schedule state do not fit TRL's); continue it with the engine that wrote it")
    steps = max_steps or cfg.total_steps
    if plan.start >= steps:
        reporter.message(f"--resume: steps 0..{plan.start - 1} in {plan.out} are complete; nothing to run "
                         f"(--steps {steps}): pass a larger --steps to continue")
        return Path(cfg.out_dir)
    progress = Progress(done=plan.start)
    with GracefulStop() as stop, contextlib.ExitStack() as hold:
        try:
            _train_trl(cfg, plan, steps=steps, reporter=reporter, overwrite=overwrite,
                       stop=stop, hold=hold, progress=progress)
        except Stopped as exc:
            reporter.finish()
            raise TrainingStopped(exc.signum, out=plan.out, started=progress.started, step=progress.step,
                                  first=plan.start, done=progress.done,
                                  checkpoint=latest_checkpoint(plan.out) if progress.started else None) from None
    return Path(cfg.out_dir)


def _train_trl(cfg: Any, plan: Any, *, steps: int, reporter: Any, overwrite: bool, stop: Any, hold: Any,
               progress: Any) -> None:
    import os

    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from icsd_audit.integrations.trl.trainer import ICSDConfig, ICSDGRPOTrainer
    from icsd_audit.integrations.trl.rollout import EpisodeRollout, episode_reward
    from icsd_audit.runs.recorder import manifest_callback
    from icsd_audit.runs.trackers import hf_report_to
    from icsd_audit.train.loop import draw_tasks
    from icsd_audit.train.setup import env_factory as make_env_factory
    from icsd_audit.train.models.loading import load_policy, resolve_precision
    from icsd_audit.train.models.loading import resolve_device, set_threads
    from icsd_audit.train.run.folder import drop_steps_from, open_run_folder
    from icsd_audit.train.update.schedule import warmup_steps
    from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings, turn_context
    from icsd_audit.train.teacher.skills import load_skillbank
    from icsd_audit.train.teacher.self_teacher import skill_retriever

    out, start = Path(cfg.out_dir), plan.start
    set_threads(cfg.threads)  # as the built-in loop: the idle cores unless told (shared cores, docs/models.md)
    dev = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, dev)
    model, tok, peft_config = _trl_policy(cfg, dev)
    factory = make_env_factory(cfg)
    probe = factory(cfg.train_split)
    builder = PromptBuilder.from_config(tok, cfg)
    # step s plays the built-in loop's tasks of step s: the dataset lists them in order and TRL does not
    # shuffle it. The rollout finds a task from its first prompt; tasks sharing a first prompt (3 of
    # WebShop's 1900) are played as the first of them, and the dataset's task column says so.
    tasks: dict[str, int] = {}
    rows = []
    for step in range(start, steps):  # a resumed run's data loader starts at its first step
        for t in draw_tasks(cfg.seed, step, probe.num_tasks, cfg.n_tasks):
            text = builder.student_text(turn_context(probe.reset(t), cfg.env))
            rows.append({"prompt": text, "task": tasks.setdefault(text, t)})
    settings = RolloutSettings(max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                               temperature=cfg.temperature, batch_rows=cfg.rollout_batch_rows,
                               require_think=cfg.require_think, reward=cfg.reward, record_logp=True,
                               precision=precision, invalid_rule=cfg.invalid_rule)
    teacher_skill = (skill_retriever(load_skillbank(cfg.skillbank_name), skill_mode=cfg.teacher_skill_mode,
                                     skill_match=cfg.skill_match) if cfg.distill_enabled else None)
    rollout = EpisodeRollout(tokenizer=tok, builder=builder, make_env=lambda: factory(cfg.train_split),
                             settings=settings, invalid_penalty=cfg.invalid_penalty, tasks=tasks,
                             teacher_skill=teacher_skill)
    # an episode's prompt + completion <= max_prompt_tokens + max_response_tokens (trl_rollout's bound); TRL
    # reads max_completion_length only for its own generation and the 'dr_grpo' loss, neither used here
    args = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=cfg.n_tasks * cfg.group_size,
                      num_generations=cfg.group_size, max_completion_length=cfg.max_prompt_tokens + cfg.max_response_tokens,
                      max_steps=steps, learning_rate=cfg.lr, weight_decay=cfg.weight_decay,
                      max_grad_norm=cfg.grad_clip, beta=cfg.kl_coef, epsilon=cfg.clip_ratio,
                      # the built-in loop's schedule (.train.schedule): HF's constant_with_warmup has verl's factor
                      lr_scheduler_type="constant_with_warmup",
                      warmup_steps=warmup_steps(cfg.total_steps, cfg.lr_warmup_steps_ratio),
                      temperature=cfg.temperature, scale_rewards="group" if cfg.norm_adv_by_std else "none",
                      shuffle_dataset=False, seed=cfg.seed, use_cpu=dev.type == "cpu",
                      bf16=precision == "bf16-mixed", gradient_checkpointing=cfg.recompute_activations,
                      report_to=hf_report_to(_report_to(cfg), out),  # TRL's own trackers log its keys
                      logging_steps=1, save_strategy="no", dataloader_num_workers=0,
                      disable_tqdm=True)  # the run's reporter prints the progress (trl_run)
    # ---- the first write: hold the run folder, then make it this run's (the built-in loop's order)
    moved, removed = hold.enter_context(open_run_folder(out, resume=plan.resuming, overwrite=overwrite))
    progress.started = True
    if moved is not None:
        reporter.message(f"--overwrite: the run that was in {out} is now in {moved}")
    if removed:
        reporter.message(f"removed {len(removed)} temporary file(s) a stopped run left in {out} ({removed[0].name}, ...)")
    if plan.resuming and plan.checkpoint is None and start == 0 and (out / "config.json").exists():
        reporter.message(f"--resume: no complete checkpoint in {out / 'checkpoints'}; starting again at step 0")
    with stop.critical():
        drop_steps_from(out / "dumps", start)  # a resumed run redoes these steps
        cfg.save(out / "config.json")
    policy: Any = model
    if cfg.kl_coef > 0 and not cfg.lora_enabled:  # TRL builds its reference from a path: hand it a copy of the policy
        policy = str(out / "trl" / "initial_policy")
        if not (start and (Path(policy) / "config.json").exists()):  # a resumed run keeps the run's initial policy
            with stop.critical():
                model.save_pretrained(policy)
                tok.save_pretrained(policy)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL; tested on 1.16
    common = dict(model=policy, processing_class=tok, reward_funcs=episode_reward, args=args,
                  train_dataset=datasets.Dataset.from_list(rows), rollout_func=rollout, peft_config=peft_config,
                  callbacks=[manifest_callback(cfg, engine="trl", start_step=start)])  # run.json
    if cfg.distill_enabled:
        icsd = ICSDConfig.from_run(cfg, dump_dir=str(out / "dumps"))
        trainer: Any = ICSDGRPOTrainer(**common, icsd=icsd, producer={"model": cfg.model, "env": cfg.env,
                                                                      "adv_estimator": "grpo", "seed": cfg.seed})
    else:  # allocator 'none': plain GRPO, no teacher and no dumps, as on the built-in loop
        trainer = GRPOTrainer(**common)
    from transformers import PrinterCallback, ProgressCallback

    from icsd_audit.integrations.trl.run import run_folder_callback

    for cb in (PrinterCallback, ProgressCallback):  # TRL's raw dicts and bars: the reporter prints instead
        trainer.remove_callback(cb)
    if plan.checkpoint is not None:
        _load_checkpoint_weights(trainer.model, plan.checkpoint, cfg=cfg, device=dev)
    writer = getattr(trainer, "_writer", None)
    if writer is not None:  # a shard is written whole even when a signal arrives meanwhile
        write = writer.write

        def write_whole(**kw: Any) -> Any:
            with stop.critical():
                return write(**kw)

        writer.write = write_whole
    folder = run_folder_callback(cfg, reporter=reporter, steps=steps,
                                 distill_coef=cfg.effective_distill_coef if cfg.distill_enabled else 0.0,
                                 start=start, saved=plan.state, writer=writer, trainer=trainer, stop=stop,
                                 progress=progress)
    trainer.add_callback(folder)
    try:
        trainer.train()
    except BaseException:
        folder.discard()  # nothing of an unfinished step is published
        raise
    reporter.message(f"done: steps {start}..{steps - 1}; metrics {out / 'metrics.jsonl'}"
                     + (f"; dumps {out / 'dumps'}" if cfg.distill_enabled else "")
                     + (f"; checkpoint {folder.checkpoint}" if folder.checkpoint else ""))


def _load_checkpoint_weights(model: Any, ckpt: Path, *, cfg: Any, device: Any) -> None:
    """Put the policy weights of checkpoint ``ckpt`` into TRL's ``model`` (the adapter only, under LoRA).

    TRL is built exactly as for a fresh run (its reference is the run's initial policy) and
    then takes the checkpoint's weights, so a resumed run trains what the stopped one held.
    """
    if hasattr(model, "peft_config"):  # LoRA: the checkpoint holds the trained adapter
        from peft import load_peft_weights, set_peft_model_state_dict

        set_peft_model_state_dict(model, load_peft_weights(str(ckpt), device=str(device)), adapter_name="default")
        return
    from icsd_audit.train.models.loading import load_policy

    saved, _ = load_policy(str(ckpt), device=device, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    model.load_state_dict(saved.state_dict())
