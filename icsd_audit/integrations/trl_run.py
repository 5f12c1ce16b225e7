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
* ``checkpoints/step-NNNNNN``: :func:`~icsd_audit.train.checkpoint.save_checkpoint` every
  ``checkpoint_every`` steps and after the last one (the model, tokenizer, AdamW state unless
  ``checkpoint_optimizer`` is off, RNG state and the config), keeping the newest ``keep_checkpoints``;
* the progress: the run's :class:`~icsd_audit.train.metrics.Reporter` gets ``start``, one
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


def run_folder_callback(cfg: Any, *, reporter: Any, steps: int, distill_coef: float) -> Any:
    """A ``TrainerCallback`` writing ``metrics.jsonl`` and checkpoints into ``cfg.out_dir`` (module docstring)."""
    from transformers import TrainerCallback

    from icsd_audit.train.checkpoint import save_checkpoint
    from icsd_audit.train.metrics import MetricsLog

    out = Path(cfg.out_dir)

    class _Callback(TrainerCallback):
        def __init__(self) -> None:
            self.log = MetricsLog(out / "metrics.jsonl", start_step=0)
            self.checkpoint: Path | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            reporter.start(total_steps=steps, start_step=0, out_dir=str(out))

        def on_step_end(self, args: Any, state: Any, control: Any, *, model: Any = None, processing_class: Any = None,
                        optimizer: Any = None, **kw: Any) -> None:
            done = int(state.global_step)
            if done >= steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                self.checkpoint = save_checkpoint(out, next_step=done, model=model, tokenizer=processing_class,
                                                  optimizer=optimizer, config=cfg.to_dict(),
                                                  keep=cfg.keep_checkpoints, with_optimizer=cfg.checkpoint_optimizer)

        def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
                   **kw: Any) -> None:
            if not logs or "step_time" not in logs:  # TRL's end-of-training summary is not a step
                return
            rec = trl_record(int(state.global_step) - 1, logs, distill_coef=distill_coef)
            self.log.write(rec)
            reporter.step_done(rec["step"], rec)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            reporter.finish()

    return _Callback()
