"""Before and after a run of :func:`~icsd_audit.train.loop.train`: what it starts from, and what a stop reports.

:func:`plan_run` does every check that needs no model and writes nothing: the run
folder (:mod:`.rundir`), an ``--out`` that is, holds or lies inside an input, and the
checkpoint a resume continues from (read without running code, :mod:`.checkpoint`).
:func:`check_services` sends one request to each server the run depends on.
:class:`TrainingStopped` is what ``train`` raises on SIGTERM or SIGINT: which steps are
complete and the one line saying how to continue.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icsd_audit.outputs import Stopped, check_not_input
from icsd_audit.train.run.checkpoint import (STATE_FILE, CheckpointError, check_optimizer_fits, checkpoint_dir,
                                         is_checkpoint, latest_checkpoint, load_trainer_state)
from icsd_audit.train.config import TrainConfig
from icsd_audit.train.run.metrics import kept_lines
from icsd_audit.train.run.folder import RunFolderError, check_run_folder, committed_steps, held_run, stop_line

__all__ = ["Plan", "plan_run", "resume_checkpoint", "check_services", "TrainingStopped", "Progress",
           "MAY_CHANGE_ON_RESUME", "check_same_run", "nothing_to_run", "restore_optimizer"]

#: The only config fields a resumed run may set differently from the run it continues (docs/training.md, "What may
#: change on resume"): none of them changes a number the run trains, dumps or logs. Any other difference is refused.
MAY_CHANGE_ON_RESUME = {
    "total_steps": "how many steps to run in all",
    "out_dir": "where the run folder is (--resume-from into a new --out)",
    "threads": "CPU threads",
    "report_to": "experiment trackers",
    "checkpoint_every": "how often checkpoints are written",
    "keep_checkpoints": "how many checkpoints are kept",
    "checkpoint_optimizer": "whether checkpoints hold AdamW's moments",
    "recompute_activations": "activation checkpointing (same numbers bit for bit)",
    "spill_optimizer_state": "AdamW's moments kept on disk between steps (same numbers bit for bit)",
    "resident_reference": "the KL reference kept in memory or reloaded per pass (same numbers)",
    "trim_memory": "freed memory handed back to the OS after each phase (same numbers bit for bit)",
}


def check_same_run(cfg: TrainConfig, recorded: Any, *, where: Path) -> None:
    """Refuse, in one line, a resume whose config differs from the run's (``recorded``, read from ``where``)
    in any field outside :data:`MAY_CHANGE_ON_RESUME`, naming each field with its old and new value."""
    if not isinstance(recorded, dict):
        raise RunFolderError(f"{where}: the run's configuration is {type(recorded).__name__}, not a JSON object")
    default = TrainConfig().to_dict()  # a field an older version did not record ran with its default
    now = cfg.to_dict()
    changed = [f"{k} {recorded.get(k, default[k])!r} -> {v!r}" for k, v in now.items()
               if k not in MAY_CHANGE_ON_RESUME and recorded.get(k, default[k]) != v]
    if changed:
        raise RunFolderError(
            f"--resume: this command would change what the run in {cfg.out_dir} trains or records: {'; '.join(changed)} "
            f"(the run's values are in {where}); resume with the run's own settings, or start a new run with another "
            f"--out; only {', '.join(MAY_CHANGE_ON_RESUME)} may change on resume")


def resume_checkpoint(cfg: TrainConfig, resume: str | Path | bool | None) -> Path | None:
    """The checkpoint a resume continues from: the newest complete one (None: start again at step 0), or the one given.

    A checkpoint given by path must be this run folder's own or start a new folder: one
    older than checkpoints already in ``out_dir`` would splice two histories together.
    """
    if resume in (None, False, ""):
        return None
    out = Path(cfg.out_dir)
    if resume is True or str(resume) in ("auto", "latest"):
        return latest_checkpoint(out)
    p = Path(resume)
    if not is_checkpoint(p):
        raise CheckpointError(f"--resume-from {p}: not a checkpoint folder (no trainer_state.json); "
                              f"pass a folder under <out>/checkpoints/")
    own = checkpoint_dir(out).resolve() == p.resolve().parent
    if not own and held_run(out):
        raise CheckpointError(f"--resume-from {p} is not a checkpoint of --out {out}, which holds another run; "
                              "continue from it into a new --out")
    newest = latest_checkpoint(out)
    if own and newest is not None and newest.resolve() != p.resolve() and newest.name > p.name:
        raise CheckpointError(f"--resume-from {p}: {newest} is newer; resuming from an older checkpoint would splice "
                              "two histories into one folder: continue from it into a new --out instead")
    return p


@dataclass
class Plan:
    """What the read-only checks before a run decided."""

    out: Path
    resuming: bool
    checkpoint: Path | None
    state: dict[str, Any] | None
    start: int


def plan_run(cfg: TrainConfig, *, resume: str | Path | bool | None, overwrite: bool) -> Plan:
    """Every check that needs no model and writes nothing: the run folder, inputs, the resume checkpoint."""
    out = Path(cfg.out_dir)
    resuming = resume not in (None, False, "")
    check_not_input(out, cfg.input_paths(), option="--out")
    check_run_folder(out, resume=resuming, overwrite=overwrite)
    ckpt = resume_checkpoint(cfg, resume)
    if ckpt is not None and checkpoint_dir(out).resolve() != ckpt.resolve().parent:
        check_not_input(out, {"checkpoint": str(ckpt)}, option="--out")
    state = load_trainer_state(ckpt) if ckpt is not None else None
    if state is not None:
        check_same_run(cfg, state["config"], where=ckpt / STATE_FILE)
    elif resuming and held_run(out):
        _check_unsaved_run(cfg, out)
    start = int(state["next_step"]) if state else 0
    for log in ("metrics.jsonl", "eval.jsonl"):  # read now: a resume that cannot keep them changes nothing
        if (out / log).is_file():
            kept_lines(out / log, start)
    return Plan(out, resuming, ckpt, state, start)


def _check_unsaved_run(cfg: TrainConfig, out: Path) -> None:
    """``--resume`` where the run has no checkpoint: refused when steps are complete (a resume would redo them
    from step 0, losing them); allowed when none is (nothing is lost), as the run recorded in config.json."""
    from icsd_audit.train.models.weightfiles import read_json

    done = sorted(set(committed_steps(out / "dumps")) | set(_logged_steps(out / "metrics.jsonl")))
    if done:
        raise RunFolderError(
            f"--resume: {out} holds {len(done)} completed step(s) ({done[0]}..{done[-1]}) but no checkpoint, so "
            "they cannot be continued and a resume would redo them from step 0; keep them and start again with "
            f"--overwrite (it moves them to {out.name}.old-<date>), or set checkpoint_every so a run can be resumed")
    if (out / "config.json").exists():
        check_same_run(cfg, read_json(out / "config.json", what="run configuration"), where=out / "config.json")


def _logged_steps(path: Path) -> list[int]:
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in kept_lines(path, 2**62)]


def nothing_to_run(plan: Plan, total_steps: int) -> str:
    """The line of a resume whose checkpoint is at or past ``total_steps``: it runs and writes nothing."""
    return (f"--resume: steps 0..{plan.start - 1} in {plan.out} are complete; nothing to run (--steps {total_steps}) "
            "and nothing changed: pass a larger --steps to continue")


def restore_optimizer(optimizer: Any, state: dict[str, Any], where: Path | None) -> None:
    """Load a checkpoint's AdamW state, refused in one line when it does not fit the parameters being trained."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    check_optimizer_fits(state, params, where or "the checkpoint")
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: its optimizer state does not fit this model "
                              f"({' '.join(str(exc).split())[:160]})") from None


def check_services(cfg: TrainConfig) -> None:
    """One request to each server the run depends on, before any work: a dead one fails now, not mid-run."""
    if cfg.env == "searchqa" and cfg.retriever_url:
        from icsd_audit.envs.searchqa import ServerRetriever

        try:
            ServerRetriever(cfg.retriever_url, timeout=30.0).search(["icsd start-up probe"], 1)
        except (ConnectionError, ValueError) as exc:
            raise ConnectionError(f"retriever_url: {exc} (probed once at start)") from None


class TrainingStopped(Stopped):
    """:func:`train` stopped by SIGTERM or SIGINT: what is complete, and :meth:`line` to say how to continue."""

    def __init__(self, signum: int, *, out: Path, started: bool, step: int | None, first: int, done: int,
                 checkpoint: Path | None):
        self.out, self.started, self.step, self.first, self.done = out, started, step, first, done
        self.checkpoint = checkpoint
        super().__init__(signum)
        self.args = (self.line(),)

    def line(self, resume_command: str | None = None, fresh_command: str | None = None) -> str:
        return stop_line(self.signal_name, out=self.out, started=self.started, step=self.step, first=self.first,
                         done=self.done, checkpoint=self.checkpoint, resume_command=resume_command,
                         fresh_command=fresh_command)


@dataclass
class Progress:
    """Where a run stands, for the line a stop prints."""

    done: int
    started: bool = False
    step: int | None = None
