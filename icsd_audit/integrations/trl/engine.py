"""``icsd train --engine trl``: :class:`~icsd_audit.integrations.trl.trainer.ICSDGRPOTrainer` on the built-in run.

The same model, allocator, lambda, seed, learning rate, step count, group size and tasks per step (the built-in
loop's draw), with whole multi-turn episodes from :class:`~icsd_audit.integrations.trl.rollout.EpisodeRollout` as
TRL's ``rollout_func``: one TRL row per episode (first student prompt; replies and observations as one
conversation, observations masked out), turns judged and rewards shaped by the built-in loop's code. TRL runs GRPO:
the advantage is per episode, and ``adv_estimator='gigpo'`` stops with one line (exit 2). What differs from the
built-in loop is in docs/engines.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from icsd_audit.integrations.checks import EngineUnavailable
from icsd_audit.outputs import GracefulStop, Stopped

__all__ = ["TRL_GRPO_LINE", "run_trl"]


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
    from icsd_audit.runs.trackers import hf_report_to, parse_report_to
    from icsd_audit.train.loop import draw_tasks
    from icsd_audit.train.setup import env_factory as make_env_factory
    from icsd_audit.train.models.loading import resolve_device, resolve_precision, set_threads
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
                      report_to=hf_report_to(parse_report_to(getattr(cfg, "report_to", None)), out),  # TRL's own trackers log its keys
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
