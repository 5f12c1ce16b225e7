"""What a training run records besides its metrics: ``run.json`` and the ``--report-to`` trackers.

:func:`record_run` wraps the loop's progress reporter, so the loop needs one line: the
manifest is written when training starts, after every step (completed steps) and at
the end, and each step's record goes to the trackers as it is logged.  If the process
dies, the manifest keeps ``status: running`` and the steps it completed, and the
trackers are closed at interpreter exit where that is still possible.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any, Mapping

from icsd_audit.runs.manifest import RunManifest
from icsd_audit.runs.trackers import Trackers, open_trackers, parse_report_to

__all__ = ["RunRecorder", "record_run", "manifest_callback"]


class RunRecorder:
    """A reporter (``icsd_audit.train.run.metrics.Reporter``) that records the run, then forwards to ``inner``."""

    def __init__(self, inner: Any, manifest: RunManifest, trackers: Trackers) -> None:
        self.inner, self.manifest, self.trackers = inner, manifest, trackers
        atexit.register(self.trackers.close)

    def start(self, *, total_steps: int, start_step: int, out_dir: str) -> None:
        self.manifest.start()
        self.inner.start(total_steps=total_steps, start_step=start_step, out_dir=out_dir)

    def phase(self, step: int, name: str) -> None:
        self.inner.phase(step, name)

    def phase_done(self, step: int, name: str, seconds: float) -> None:
        self.inner.phase_done(step, name, seconds)

    def progress(self, step: int, name: str, done: int, total: int, unit: str) -> None:
        say = getattr(self.inner, "progress", None)  # reporters written before progress() existed lack it
        if say is not None:
            say(step, name, done, total, unit)

    def step_done(self, step: int, record: Mapping[str, Any]) -> None:
        self.trackers.log(record)
        self.manifest.step(step + 1)
        self.inner.step_done(step, record)

    def message(self, text: str) -> None:
        self.inner.message(text)

    def finish(self) -> None:
        self.trackers.close()
        atexit.unregister(self.trackers.close)
        self.manifest.finish()
        self.inner.finish()


def record_run(inner: Any, cfg: Any, *, engine: str, start_step: int = 0) -> RunRecorder:
    """Wrap ``inner`` so the run in ``cfg.out_dir`` gets ``run.json`` and the trackers of ``cfg.report_to``."""
    config = cfg.to_dict()
    manifest = RunManifest(cfg.out_dir, config=config, engine=engine, seed=cfg.seed, total_steps=cfg.total_steps,
                           start_step=start_step)
    names = parse_report_to(getattr(cfg, "report_to", None))
    trackers = open_trackers(names, out_dir=cfg.out_dir, config=config) if names else Trackers({})
    return RunRecorder(inner, manifest, trackers)


def manifest_callback(cfg: Any, *, engine: str, start_step: int = 0) -> Any:
    """A Hugging Face ``TrainerCallback`` keeping ``run.json`` of a trainer-driven run (TRL) up to date.

    ``start_step``: the first step of this launch (a resumed run's).
    """
    from transformers import TrainerCallback

    class _Manifest(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.manifest = RunManifest(Path(cfg.out_dir), config=cfg.to_dict(), engine=engine, seed=cfg.seed,
                                        total_steps=cfg.total_steps, start_step=start_step)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.manifest.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.manifest.step(int(state.global_step))

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.manifest.step(int(state.global_step))
            self.manifest.finish()

    return _Manifest()
