"""The run folder of ``icsd train --engine trl``: the built-in loop's files, key names and progress lines.

:func:`run_folder_callback` builds a ``transformers.TrainerCallback`` that gives a TRL run what
``icsd train --engine builtin`` writes (docs/training.md, "Outputs"):

* ``metrics.jsonl``: one record per step with the built-in loop's key names for what both
  engines measure (:data:`SHARED_KEYS`: ``rollout/success``, ``rollout/score``, ``rollout/reward``,
  ``rollout/turns``, ``rollout/invalid_rate``, ``actor/kl``, ``actor/clip_frac``,
  ``actor/aux_loss`` (lambda included, as the built-in loop logs it), ``actor/loss``,
  ``actor/grad_norm``, ``alloc/tcm``, ``alloc/tcm_trust``, ``alloc/fallback_share``,
  ``alloc/delta_mean``, ``time/step``, ``time/rollout``, ``time/generate``, ``time/env``),
  every other TRL value under ``trl/<its name>``, and ``step`` counted from 0;
* ``dumps/stepNNNNNN/``: the step's shards, staged while it runs and committed with its
  metrics line (docs/dumps.md, "Steps commit whole"): a stopped step publishes nothing;
* ``checkpoints/step-NNNNNN``: :func:`~icsd_audit.train.run.checkpoint.save_checkpoint` every
  ``checkpoint_every`` steps and after the last one (the model, tokenizer, AdamW state unless
  ``checkpoint_optimizer`` is off, RNG state, the learning-rate schedule's state and the
  config), keeping the newest ``keep_checkpoints``; ``--resume`` continues from it;
* the progress: the run's :class:`~icsd_audit.train.run.metrics.Reporter` gets ``start``, one
  ``step_done`` per step (the built-in summary line) and ``finish``, so both engines print
  the same lines (``config.json`` is written by the engine before training).

Imports transformers lazily (the callback class is built on first use).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

__all__ = ["SHARED_KEYS", "trl_record", "run_folder_callback"]

#: built-in key <- TRL key (and a factor: TRL's aux loss is logged without lambda)
SHARED_KEYS: dict[str, str] = {
    "rollout/success": "episodes/won", "rollout/score": "episodes/score", "rollout/reward": "episodes/return",
    "rollout/turns": "episodes/turns", "rollout/invalid_rate": "episodes/invalid_turn_share",
    "actor/kl": "kl", "actor/clip_frac": "clip_ratio/region_mean", "actor/aux_loss": "icsd/aux_loss",
    "actor/loss": "loss", "actor/grad_norm": "grad_norm", "alloc/tcm": "icsd/tcm_icsd",
    "alloc/tcm_trust": "icsd/tcm_sdar", "alloc/fallback_share": "icsd/fallback_share",
    "alloc/delta_mean": "icsd/delta_mean", "time/step": "step_time", "time/rollout": "time/rollout",
    "time/generate": "time/rollout_generate", "time/env": "time/rollout_env",
}


def trl_record(step: int, logs: Mapping[str, Any], *, distill_coef: float) -> dict[str, Any]:
    """One ``metrics.jsonl`` record from TRL's log of a training step (see the module docstring)."""
    rec: dict[str, Any] = {"step": int(step)}
    used = set()
    for ours, theirs in SHARED_KEYS.items():
        if theirs in logs:
            v = logs[theirs]
            rec[ours] = distill_coef * v if ours == "actor/aux_loss" and v is not None else v
            used.add(theirs)
    rec.update({f"trl/{k}": v for k, v in logs.items() if k not in used})
    return rec


def run_folder_callback(cfg: Any, *, reporter: Any, steps: int, distill_coef: float, start: int = 0,
                        saved: Mapping[str, Any] | None = None, writer: Any = None, trainer: Any = None,
                        stop: Any = None, progress: Any = None) -> Any:
    """A ``TrainerCallback`` that runs the built-in loop's step bookkeeping in ``cfg.out_dir`` (module docstring).

    ``start``: the first step of this launch, ``saved`` the trainer state of the checkpoint it
    resumes from (:func:`~icsd_audit.train.run.checkpoint.load_trainer_state`): TRL's step counter
    starts at ``start`` and AdamW, the learning-rate schedule and the RNG streams continue from
    it, so a resumed run computes what the uninterrupted one would have. ``writer``: the
    trainer's dump writer, whose shards of a step are staged and committed with the step.
    ``stop`` (:class:`~icsd_audit.outputs.GracefulStop`) holds a signal back while the step is
    committed; ``progress`` (:class:`~icsd_audit.train.run.resume.Progress`) records how far the run got.
    """
    import contextlib

    from transformers import TrainerCallback

    from icsd_audit.train.run.checkpoint import save_checkpoint, set_rng_state
    from icsd_audit.train.run.metrics import MetricsLog

    out = Path(cfg.out_dir)
    critical = stop.critical if stop is not None else contextlib.nullcontext

    class _Callback(TrainerCallback):
        def __init__(self) -> None:
            with critical():
                self.log = MetricsLog(out / "metrics.jsonl", start_step=start)  # drops the records of redone steps
            self.checkpoint: Path | None = None
            self.staged: Any = None
            self._rng = saved.get("rng") if saved else None

        def on_train_begin(self, args: Any, state: Any, control: Any, *, optimizer: Any = None,
                           lr_scheduler: Any = None, **kw: Any) -> None:
            if start:  # continue the checkpoint's run: its step count, token count, AdamW moments and schedule
                state.global_step = start
                state.num_input_tokens_seen = int((saved or {}).get("num_input_tokens_seen") or 0)
                if trainer is not None:  # HF averages the logged loss over the steps since its last log
                    trainer._globalstep_last_logged = trainer._initial_global_step = start
                if saved and saved.get("optimizer") is not None:
                    optimizer.load_state_dict(saved["optimizer"])
                if saved and saved.get("lr_scheduler") is not None:
                    lr_scheduler.load_state_dict(saved["lr_scheduler"])
            reporter.start(total_steps=steps, start_step=start, out_dir=str(out))

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self._rng is not None:  # here, not earlier: HF draws a seed for the data loader at epoch start
                set_rng_state(self._rng)
                self._rng = None
            if progress is not None:
                progress.step = int(state.global_step)
            if writer is not None:
                self.staged = writer.step(int(state.global_step))

        def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, *,
                   model: Any = None, processing_class: Any = None, optimizer: Any = None, lr_scheduler: Any = None,
                   **kw: Any) -> None:
            if not logs or "step_time" not in logs:  # TRL's end-of-training summary is not a step
                return
            done = int(state.global_step)
            if "epoch" in logs:  # HF counts epochs over this launch's data: the run's share of its steps
                logs = {**logs, "epoch": done / steps}
            rec = trl_record(done - 1, logs, distill_coef=distill_coef)
            with critical():  # the step is complete once all of this is written; a signal waits for it
                if self.staged is not None:
                    self.staged.commit()
                    self.staged = None
                self.log.write(rec)
                if done >= steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                    extra = {"engine": "trl", "num_input_tokens_seen": int(state.num_input_tokens_seen),
                             "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict()}
                    self.checkpoint = save_checkpoint(out, next_step=done, model=model, tokenizer=processing_class,
                                                      optimizer=optimizer, config=cfg.to_dict(),
                                                      keep=cfg.keep_checkpoints, with_optimizer=cfg.checkpoint_optimizer,
                                                      extra=extra)
                if progress is not None:
                    progress.done = done
            reporter.step_done(rec["step"], rec)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if progress is not None:
                progress.step = None
            reporter.finish()

        def discard(self) -> None:
            """Drop the staged shards of an unfinished step (the run stopped inside it)."""
            if self.staged is not None:
                self.staged.discard()
                self.staged = None

    return _Callback()
