"""``train(cfg)``: rollout -> advantages -> teacher pass -> reference pass -> actor update -> logs.

Each step, top to bottom:

1. **Rollout** (:mod:`.rollout`): ``n_tasks`` tasks drawn from the train split with a
   (seed, step)-seeded RNG, ``group_size`` episodes each, batched KV-cache sampling;
   every action turn is a row with its old log-probs.
2. **Advantages** (:mod:`.advantages`): GRPO or GiGPO per row, verl-agent semantics,
   invalid-action penalty included; broadcast to the row's tokens in the actor.
3. **Old log-probs**: kept from the sampler, or recomputed by a forward pass
   (``recompute_old_logp``, verl's way).
4. **Teacher pass** (:mod:`.teacher`): the same weights, no grad, skill text prepended.
5. **Reference pass**: the frozen initial policy, no grad (skipped when ``kl_coef`` = 0).
6. **Actor update** (:mod:`.actor`): per mini-batch, the ratio pre-pass, one allocation
   over the whole mini-batch (or, ``alloc_scope='micro-batch'``, one allocation per
   gradient micro-batch from its own forward), gradient micro-batches, one optimizer step; the
   mini-batch's per-token rows go to the dump (with per-token gradient sketches when
   ``sketch_k`` > 0, :mod:`.sketching`).
7. **Metrics** (one JSONL record), **evaluation** on held-out instructions and
   **checkpoints**, on their schedules.

Algorithm choices (advantage estimator, allocator, hybrid baseline, teacher on/off,
reference on/off, old-log-prob source, reward shaping) are looked up once before the
loop; the loop body only calls what was looked up.

**How this departs from verl-agent / SDAR** (details in docs/training.md):

* One process, Hugging Face ``generate`` for sampling (no vLLM, no FSDP/Ray); micro-
  batches run one after another on one device.
* Old log-probs come from the sampler's logits by default (verl recomputes them with
  the actor; ``recompute_old_logp=True`` does that).
* The loss is a token mean over the whole actor mini-batch; verl averages each micro-
  batch and divides by the number of micro-batches.
* The allocation is computed once per actor mini-batch over all of its tokens with the
  ratio at that moment (a no-grad pre-pass; SDAR's public code allocates per micro-
  batch, which ``alloc_scope='micro-batch'`` does); its exact inputs and outputs are
  dumped for every mini-batch, not only the last micro-batch's metrics.
* SDAR wires self-distillation into GRPO only; here it composes with GRPO and GiGPO.
* The model stays in eval mode (no dropout) during the update, so the pre-pass and the
  gradient pass compute the same log-probs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from icsd_audit.envs import PRIVILEGED_ENVS
from icsd_audit.runs.recorder import record_run
from icsd_audit.train.models.loading import resolve_device, resolve_precision, set_threads
from icsd_audit.train.update.actor import Actor, StepData, make_distillation
from icsd_audit.train.update.advantages import get_estimator
from icsd_audit.outputs import GracefulStop, Stopped
from icsd_audit.threads import choose_threads
from icsd_audit.train.run.checkpoint import latest_checkpoint, save_checkpoint, set_rng_state
from icsd_audit.train.config import TrainConfig
from icsd_audit.train.eval import evaluate
from icsd_audit.train.update.hybrid import make_hybrid
from icsd_audit.train.models.memory import HEAP_LIMIT, OptimizerSpill, map_large_allocations, release_freed_memory
from icsd_audit.train.run.metrics import MetricsLog, NullReporter, Reporter, step_tcm
from icsd_audit.train.run.resume import (Plan, Progress, TrainingStopped, check_services, nothing_to_run, plan_run,
                                         restore_optimizer)
from icsd_audit.train.run.folder import drop_steps_from, held_run, open_run_folder
from icsd_audit.train.rollout.collect import PromptBuilder, RolloutBatch, RolloutSettings, collect_rollouts
from icsd_audit.train.rollout.sampling import draw_tasks, seed_step
from icsd_audit.train.update.schedule import warmup_lr
from icsd_audit.train.update.sketching import dump_sketch_metadata, make_sketcher
from icsd_audit.train.teacher.skills import load_skillbank
from icsd_audit.train.setup import EnvFactory, build_models
from icsd_audit.train.setup import env_factory as default_env_factory
from icsd_audit.train.teacher.self_teacher import make_teacher, skill_retriever

__all__ = ["train", "TrainResult", "TrainingStopped", "seed_step", "draw_tasks", "check_services"]

_log = logging.getLogger(__name__)

_ALLOC_KEYS = ("fallback_share", "degenerate_turns", "groups_batch_stats", "groups_fixed_map", "c_over_g",
               "delta_mean", "delta_pos_share", "prepass_skipped", "alloc_ratio_gap",
               "alloc_ratio_gap_skipped")


@dataclass
class TrainResult:
    """What a call to :func:`train` produced."""

    out_dir: Path
    start_step: int
    next_step: int
    metrics_path: Path
    dumps_dir: Path | None
    checkpoint: Path | None
    records: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------------------
# Set-up helpers
# --------------------------------------------------------------------------------------




class _Phases:
    """Wall-clock per named phase of one step; tells the reporter which phase runs."""

    def __init__(self, reporter: Reporter, step: int, *, trim: bool = True):
        self.t: dict[str, float] = {}
        self.reporter, self.step, self.trim = reporter, step, trim

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.reporter.phase(self.step, name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.trim:
                release_freed_memory()  # the next phase starts from what is live, not this one's high-water mark
            self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
            self.reporter.phase_done(self.step, name, self.t[name])

    def progress(self, name: str, unit: str) -> Callable[[int, int], None]:
        """``tick(done, total)`` for the phase ``name``: the reporter hears of each ``unit`` finished."""
        say = getattr(self.reporter, "progress", None)  # reporters written before progress() existed lack it

        def tick(done: int, total: int) -> None:
            if say is not None:
                say(self.step, name, done, total, unit)

        return tick


#: Estimator name -> its keyword options from the config.
ADV_OPTIONS: dict[str, Callable[[TrainConfig], dict[str, Any]]] = {
    "grpo": lambda c: {"norm_adv_by_std_in_grpo": c.norm_adv_by_std, "invalid_penalty": c.invalid_penalty},
    "gigpo": lambda c: {"gamma": c.gamma, "step_weight": c.step_weight, "mode": c.gigpo_mode,
                        "invalid_penalty": c.invalid_penalty},
}


def _rollout_old_logp(step: int, data: StepData) -> list[torch.Tensor]:
    return data.old_logp


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------


def train(cfg: TrainConfig, *, resume: str | Path | bool | None = None, reporter: Reporter | None = None,
          env_factory: EnvFactory | None = None, overwrite: bool = False) -> TrainResult:
    """Train ``cfg.total_steps`` steps (from the checkpoint given by ``resume``, if any).

    ``resume``: ``True``/``"latest"`` continues the run in ``cfg.out_dir`` from its newest
    complete checkpoint (from step 0 when it has none; a new run when the folder is
    empty), or a checkpoint folder. A folder that holds another run is refused unless
    ``resume`` or ``overwrite`` (which moves the old run aside, :mod:`.rundir`). Every
    check runs before the first byte is written. ``env_factory(split)`` replaces the
    built-in environment (any :class:`~icsd_audit.envs.TextEnv`).

    SIGTERM and SIGINT stop the run gracefully: the file being written is finished, the
    step in progress is not committed (its staged dumps are dropped), and
    :class:`TrainingStopped` (exit code 143 / 130) says which steps are complete and how to
    continue.
    """
    cfg.validate_training()  # before any model loads
    reporter = reporter or NullReporter()
    plan = plan_run(cfg, resume=resume, overwrite=overwrite)
    if env_factory is None:
        check_services(cfg)
    if plan.resuming and plan.start >= cfg.total_steps:  # a resume that runs no step changes nothing
        reporter.message(nothing_to_run(plan, cfg.total_steps))
        return TrainResult(out_dir=plan.out, start_step=plan.start, next_step=plan.start,
                           metrics_path=plan.out / "metrics.jsonl", dumps_dir=None, checkpoint=plan.checkpoint)
    progress = Progress(done=plan.start)
    with GracefulStop() as stop, contextlib.ExitStack() as hold:
        try:
            return _train(cfg, plan, reporter=reporter, env_factory=env_factory, overwrite=overwrite, stop=stop,
                          hold=hold, progress=progress)
        except Stopped as exc:
            reporter.finish()
            raise TrainingStopped(exc.signum, out=plan.out, started=progress.started, step=progress.step,
                                  first=plan.start, done=progress.done,
                                  checkpoint=latest_checkpoint(plan.out) if progress.started else None) from None


def _train(cfg: TrainConfig, plan: Plan, *, reporter: Reporter, env_factory: EnvFactory | None, overwrite: bool,
           stop: GracefulStop, hold: contextlib.ExitStack, progress: Progress) -> TrainResult:
    out, ckpt, state, start = plan.out, plan.checkpoint, plan.state, plan.start
    # why this many threads, read when they are chosen (the log line waits for the model's)
    threads = choose_threads(cfg.threads)
    set_threads(threads.n)
    if cfg.trim_memory:
        map_large_allocations(HEAP_LIMIT)  # heap below 32 MB; the actor's gradient pass maps 1 MB blocks (see .memory)
    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)

    # ---- models: the policy, and the initial policy for the KL (a frozen copy, or the adapter switched off)
    models = build_models(cfg, device=device, ckpt=ckpt, precision=precision)
    if device.type == "cpu":
        _log.info("torch computes on %d CPU thread(s) (%s)", torch.get_num_threads(), threads.why)
    policy, tokenizer, reference, pad_id, score_kw = (models.policy, models.tokenizer, models.reference, models.pad_id,
                                                       models.score_kw)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                                  betas=(0.9, 0.999), weight_decay=cfg.weight_decay)
    if state and state.get("optimizer") is not None:  # checked against this model before the folder changes
        restore_optimizer(optimizer, state["optimizer"], ckpt)
    spill_on = cfg.spill_optimizer_state if cfg.spill_optimizer_state is not None else device.type == "cpu"
    spill = OptimizerSpill(optimizer, enabled=spill_on, directory=str(out))

    # ---- everything chosen by name, looked up once
    estimator = get_estimator(cfg.adv_estimator)
    adv_options = ADV_OPTIONS[cfg.adv_estimator](cfg)
    distill = make_distillation(cfg)
    hybrid = make_hybrid(cfg)  # Skill-SD / RLSD (allocator 'none'): the teacher without an allocation
    # an environment that gives its own privileged text (the clue) needs a bank only when one is named
    wants_bank = cfg.env not in PRIVILEGED_ENVS or cfg.skillbank is not None
    bank = (load_skillbank(cfg.skillbank_name)
            if wants_bank and (cfg.teacher_enabled or cfg.student_skills != "off") else None)

    def make_builder(student_sees_skills: bool) -> PromptBuilder:
        skill = (skill_retriever(bank, skill_mode=cfg.skill_mode, skill_match=cfg.skill_match)
                 if student_sees_skills and bank is not None else None)
        return PromptBuilder.from_config(tokenizer, cfg, student_skill=skill)

    builder = make_builder(cfg.student_skills in ("train", "both"))
    eval_builder = make_builder(cfg.student_skills in ("eval", "both"))
    teacher = make_teacher(cfg.teacher_enabled, model=policy, builder=builder,
                           bank=bank if cfg.teacher_enabled else None,
                           skill_mode=cfg.teacher_skill_mode, skill_match=cfg.skill_match,
                           micro_batch_rows=cfg.micro_batch_rows, **score_kw)
    sketcher = make_sketcher(cfg, policy) if distill.enabled and cfg.dump_every else None
    factory = env_factory or default_env_factory(cfg)
    envs = [factory(cfg.train_split) for _ in range(cfg.n_tasks * cfg.group_size)]
    num_tasks = envs[0].num_tasks
    settings = RolloutSettings(max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                               temperature=cfg.temperature, batch_rows=cfg.rollout_batch_rows,
                               require_think=cfg.require_think, reward=cfg.reward,
                               record_logp=not cfg.recompute_old_logp, precision=precision,
                               invalid_rule=cfg.invalid_rule)
    actor = Actor(policy, optimizer, distill=distill, clip_ratio=cfg.clip_ratio, dual_clip=cfg.dual_clip,
                  kl_coef=cfg.kl_coef, temperature=cfg.temperature, mini_batch_rows=cfg.mini_batch_rows,
                  micro_batch_rows=cfg.micro_batch_rows, ppo_epochs=cfg.ppo_epochs, grad_clip=cfg.grad_clip,
                  skip_first_prepass=cfg.skip_first_prepass, shuffle_rows=cfg.shuffle_rows, seed=cfg.seed,
                  pad_id=pad_id, device=device, precision=precision, sketcher=sketcher,
                  alloc_scope=cfg.alloc_scope, teacher_rescore=cfg.teacher_rescore, pg_coef=cfg.pg_coef,
                  recompute_activations=cfg.recompute_activations, spill=spill, hybrid=hybrid,
                  trim_memory=cfg.trim_memory,
                  lr_schedule=lambda s: warmup_lr(s, lr=cfg.lr, total_steps=cfg.total_steps, ratio=cfg.lr_warmup_steps_ratio))
    old_logp_pass = actor.recompute_old_logp if cfg.recompute_old_logp else _rollout_old_logp

    # ---- the first write: hold the run folder, then make it this run's
    moved, removed = hold.enter_context(open_run_folder(out, resume=plan.resuming, overwrite=overwrite))
    progress.started = True
    if moved is not None:
        reporter.message(f"--overwrite: the run that was in {out} is now in {moved}")
    if removed:
        reporter.message(f"removed {len(removed)} temporary file(s) a stopped run left in {out} ({removed[0].name}, ...)")
    if plan.resuming and ckpt is None and held_run(out):  # plan_run refused one with complete steps
        reporter.message(f"--resume: {out} holds no complete step and no checkpoint; starting at step 0")
    with stop.critical():
        drop_steps_from(out / "dumps", start)  # a resumed run redoes these steps
        writer = (_dump_writer(cfg, out, sketcher, env_data=getattr(envs[0], "data_info", None), weights=models.info)
                  if (distill.enabled and cfg.dump_every) else None)
        log = MetricsLog(out / "metrics.jsonl", start_step=start)
        eval_log = MetricsLog(out / "eval.jsonl", start_step=start)
        cfg.save(out / "config.json")
    if state:
        set_rng_state(state["rng"])
    result = TrainResult(out_dir=out, start_step=start, next_step=start, metrics_path=log.path,
                         dumps_dir=None if writer is None else writer.out_dir, checkpoint=ckpt)
    reporter = record_run(reporter, cfg, engine="builtin", start_step=start)  # run.json, --report-to trackers
    reporter.start(total_steps=cfg.total_steps, start_step=start, out_dir=str(out))
    if state and state.get("optimizer") is None:
        reporter.message(f"{ckpt} holds no optimizer state (checkpoint_optimizer=False): AdamW restarts from zero moments")

    for step in range(start, cfg.total_steps):
        progress.step = step
        staged = writer.step(step) if (writer is not None and step % cfg.dump_every == 0) else None
        try:
            t_step = time.perf_counter()
            phase = _Phases(reporter, step, trim=cfg.trim_memory)
            seed_step(cfg.seed, step)
            tasks = draw_tasks(cfg.seed, step, num_tasks, cfg.n_tasks)

            with phase("rollout"):
                batch = collect_rollouts(model=policy, tokenizer=tokenizer, builder=builder, envs=envs, tasks=tasks,
                                         group_size=cfg.group_size, settings=settings, device=device)
            with phase("advantages"):
                adv = estimator(batch.turn_records(), **adv_options)
            data = _step_data(batch, adv.advantages)
            with phase("old_logp"):
                data.old_logp = old_logp_pass(step, data)
            with phase("teacher"):
                data.teacher_logp = teacher.score(batch.rows)
                data.teacher_prompts = teacher.last_prompts if cfg.teacher_rescore else None
            with phase("reference"):
                data.ref_logp = reference.score(data.prompts, data.responses, cfg.micro_batch_rows)
            sink = _critical_sink(writer, stop) if staged is not None else None
            with phase("actor"):
                actor_m, actor_t, pooled = actor.update(step, data, sink=sink, dump_columns={"env": cfg.env},
                                                        progress=phase.progress("actor", "mini-batch"))

            record = _record(step, batch, adv.metrics(), actor_m, actor_t, pooled, phase.t, teacher.last_stats,
                             cfg.alloc_eps, time.perf_counter() - t_step)
            last = step == cfg.total_steps - 1
            ev = None
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last):
                t0 = time.perf_counter()
                reporter.phase(step, "eval")
                ev = evaluate(model=policy, tokenizer=tokenizer, builder=eval_builder,
                              make_env=lambda: factory(cfg.eval_split), n_tasks=cfg.eval_tasks,
                              max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                              temperature=cfg.eval_temperature, require_think=cfg.require_think,
                              batch_rows=cfg.rollout_batch_rows, device=device, seed=cfg.seed, split=cfg.eval_split,
                              precision=precision, invalid_rule=cfg.invalid_rule).to_dict()
                ev["step"] = step
                record.update({f"eval/{k}": v for k, v in ev.items()
                               if k not in ("step", "split", "subsets", "subset_tasks")})
                record.update({f"eval/subsets/{g}": v for g, v in ev.get("subsets", {}).items()})
                record["time/eval"] = time.perf_counter() - t0
            checkpoint = bool((cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or last)
            if checkpoint:
                reporter.phase(step, "checkpoint")
            with stop.critical():  # the step is complete once all of this is written; a signal waits for it
                if staged is not None:
                    staged.commit()
                log.write(record)
                if ev is not None:
                    eval_log.write(ev)
                if checkpoint:
                    with spill.resident():
                        result.checkpoint = save_checkpoint(out, next_step=step + 1, model=models.saver,
                                                            tokenizer=tokenizer, optimizer=optimizer,
                                                            config=cfg.to_dict(), keep=cfg.keep_checkpoints,
                                                            with_optimizer=cfg.checkpoint_optimizer)
                progress.done = step + 1
        except BaseException:
            if staged is not None:
                staged.discard()  # nothing of an unfinished step is published
            raise
        if ev is not None:
            result.evals.append(ev)
        result.records.append(record)
        result.next_step = step + 1
        reporter.step_done(step, record)
    progress.step = None
    spill.close()
    reporter.finish()
    return result


# --------------------------------------------------------------------------------------
# Step assembly
# --------------------------------------------------------------------------------------


def _critical_sink(writer: Any, stop: GracefulStop) -> Callable[[str, dict[str, Any]], None]:
    """The actor's dump sink: each shard is written whole even when a signal arrives meanwhile."""

    def sink(name: str, cols: dict[str, Any]) -> None:
        with stop.critical():
            writer.write(name=name, **cols)

    return sink


def _dump_writer(cfg: TrainConfig, out: Path, sketcher: Any = None, env_data: dict[str, Any] | None = None,
                 weights: dict[str, Any] | None = None) -> Any:
    from icsd_audit.version import __version__
    from icsd_audit.dumps.writer import DumpWriter

    d = out / "dumps"
    producer = {"name": "icsd.train", "engine": "builtin", "engine_version": __version__, "rank": 0, "world_size": 1,
                "model": cfg.model, "env": cfg.env, "adv_estimator": cfg.adv_estimator, "seed": cfg.seed,
                "out_dir": str(out), **(weights or {})}
    meta: dict[str, Any] = {"train_config": json.loads(json.dumps(cfg.to_dict()))}
    if sketcher is not None:
        meta["sketch"] = dump_sketch_metadata(sketcher)
    if env_data:  # where the environment's tasks come from (e.g. Search-QA's KB, labelled synthetic)
        meta["env_data"] = json.loads(json.dumps(env_data))
    return DumpWriter(d, producer=producer, synthetic=False, allocation=cfg.allocator_settings(), metadata=meta)


def _step_data(batch: RolloutBatch, advantages: torch.Tensor) -> StepData:
    rows = batch.rows
    trajs = {t.traj: t for t in batch.trajectories}
    empty = torch.zeros(0)
    return StepData(
        prompts=[r.prompt_ids for r in rows],
        responses=[r.response_ids for r in rows],
        old_logp=[r.old_logp if r.old_logp is not None else empty for r in rows],
        advantage=advantages.float(),
        traj=torch.as_tensor([r.traj for r in rows], dtype=torch.long),
        turn=torch.as_tensor([r.turn for r in rows], dtype=torch.long),
        row_columns={
            "task": [r.task for r in rows],
            "rollout": [r.rollout for r in rows],
            "group": [r.slot for r in rows],
            "reward": [trajs[r.traj].ret for r in rows],
            "score": [trajs[r.traj].score for r in rows],
            "won": [trajs[r.traj].won for r in rows],
            "action_valid": [r.action_valid for r in rows],
        },
    )


def _record(step: int, batch: RolloutBatch, adv_m: dict[str, float], actor_m: dict[str, float],
            actor_t: dict[str, float], pooled: dict[str, np.ndarray], phases: dict[str, float],
            teacher_stats: dict[str, float], eps: float, step_seconds: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"step": step}
    rec.update({f"rollout/{k}": v for k, v in batch.metrics().items()})
    rec.update(adv_m)
    for k, v in actor_m.items():
        rec[k if k.startswith("hybrid/") else ("alloc/" if k in _ALLOC_KEYS else "actor/") + k] = v
    rec.update({f"alloc/{k}": v for k, v in step_tcm(pooled, eps=eps).items()})
    rec.update({f"teacher/{k}": v for k, v in teacher_stats.items()})
    for k, v in phases.items():
        rec[f"time/{k}"] = v
    dump_t = actor_t.get("dump", 0.0)
    rec["time/actor"] = phases.get("actor", 0.0) - dump_t  # the update proper, dump writing excluded
    rec["time/dump"] = dump_t
    rec["time/allocation"] = actor_t.get("allocation", 0.0)
    rec["time/prepass"] = actor_t.get("prepass", 0.0)
    rec["time/teacher_rescore"] = actor_t.get("teacher_rescore", 0.0)
    rec["time/actor_grad"] = actor_t.get("grad", 0.0)  # gradient micro-batches, sketching included
    rec["time/sketch"] = actor_t.get("sketch", 0.0)
    rec["time/generate"] = batch.timings.get("generate", 0.0)
    rec["time/env"] = batch.timings.get("env", 0.0)
    rec["time/step"] = step_seconds
    return rec
