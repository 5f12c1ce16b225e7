"""Step metrics: the JSONL log, the per-step TCM, and the progress-reporting protocol.

``metrics.jsonl`` gets one JSON object per training step (keys are flat strings such as
``rollout/success`` or ``time/actor``; docs/training.md lists them). On resume, records
of steps at or after the resumed step are dropped first, so the file never holds a
step twice.

The training loop reports progress through a :class:`Reporter`; the library ships a
silent one and a plain-text one, and the CLI adds a rich progress bar (rich stays out
of the library, as the architecture asks).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np

__all__ = ["MetricsLog", "Reporter", "NullReporter", "PrintReporter", "step_tcm", "clean", "clock", "summary_line"]


def clean(x: Any) -> Any:
    """JSON-safe value: non-finite floats become None, numpy scalars become Python ones."""
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.bool_,)):
        return bool(x)
    if isinstance(x, Mapping):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


class MetricsLog:
    """Append-only JSONL, one record per step, flushed at once."""

    def __init__(self, path: str | Path, *, start_step: int = 0):
        from icsd_audit.outputs import write_text_atomic

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line from a crash
                if int(rec.get("step", -1)) < start_step:
                    kept.append(line)
            write_text_atomic(self.path, "".join(k + "\n" for k in kept))

    def write(self, record: Mapping[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(clean(record), sort_keys=True) + "\n")
            fh.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def step_tcm(arrays: Mapping[str, np.ndarray], eps: float = 1e-4) -> dict[str, float]:
    """TCM and sign-region shares (SPEC 6) of one step's deployed tokens under the trust g and the coefficient c.

    Keys: ``tcm`` / ``tcm_trust`` (under c / g), ``tcm_active_tokens``, and ``share/REGION`` /
    ``share_trust/REGION`` for the regions of :data:`icsd_audit.stats.results.REGIONS`
    (the per-step mechanism trajectory ``icsd compare`` draws).  Point estimates only
    (``icsd audit tcm|quadrants`` add bootstrap intervals); computed by
    :func:`icsd_audit.stats.api.tcm` and :func:`~icsd_audit.stats.api.quadrants` with one
    resample, so the definitions live in one place.
    """
    if not arrays or arrays.get("c") is None or np.asarray(arrays["c"]).size == 0:
        return {}
    from icsd_audit.stats.api import quadrants, tcm
    from icsd_audit.tokens import Tokens, Weights

    a = {k: np.asarray(v) for k, v in arrays.items()}
    f64 = {k: a[k].astype(np.float64) for k in ("delta", "advantage", "ratio", "g", "c")}
    tokens = Tokens(advantage=f64["advantage"], ratio=f64["ratio"], delta=f64["delta"], traj_id=a["traj_id"],
                    turn_id=a["turn_id"], batch_id=a["batch_id"])
    weights = Weights(f64["g"], f64["c"])
    out: dict[str, float] = {}
    try:
        res = tcm(tokens, weights, eps=eps, n_resamples=1, rng=0)
        out.update({"tcm": float(res.compare.estimate), "tcm_trust": float(res.base.estimate),
                    "tcm_active_tokens": float(res.n_active_tokens)})
    except ValueError:
        out.update({"tcm": float("nan"), "tcm_trust": float("nan"), "tcm_active_tokens": 0.0})
    try:
        q = quadrants(tokens, weights, n_resamples=1, rng=0)
    except ValueError:
        return out
    for region, p in q.regions.items():
        out[f"share/{region}"] = float(p.compare.estimate)
        out[f"share_trust/{region}"] = float(p.base.estimate)
    return out


class Reporter(Protocol):
    """What the training loop tells the outside world."""

    def start(self, *, total_steps: int, start_step: int, out_dir: str) -> None: ...

    def phase(self, step: int, name: str) -> None: ...

    def phase_done(self, step: int, name: str, seconds: float) -> None: ...

    def step_done(self, step: int, record: Mapping[str, Any]) -> None: ...

    def message(self, text: str) -> None: ...

    def finish(self) -> None: ...


class NullReporter:
    """Says nothing: the reporter of library calls and tests (a null object, so the
    loop never branches on whether anyone is listening)."""

    def start(self, *, total_steps: int, start_step: int, out_dir: str) -> None:
        return None

    def phase(self, step: int, name: str) -> None:
        return None

    def phase_done(self, step: int, name: str, seconds: float) -> None:
        return None

    def step_done(self, step: int, record: Mapping[str, Any]) -> None:
        return None

    def message(self, text: str) -> None:
        return None

    def finish(self) -> None:
        return None


#: How the loop's phase names read in logs (the metrics keep the short names: time/actor, ...).
PHASE_LABELS = {"old_logp": "old log-probs", "teacher": "teacher pass", "reference": "reference pass",
                "actor": "actor update"}


def clock(seconds: float) -> str:
    """``h:mm:ss`` (or ``m:ss`` under an hour) of a duration."""
    s = int(round(max(seconds, 0.0)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class PrintReporter(NullReporter):
    """Plain lines on stderr for logs: one per phase (with its time and the run's elapsed
    time), one summary per step with an ETA from the mean step time so far.

    Lines are written whole with ``print`` and never wrapped, whatever the width.
    Other phases than rollout, teacher, reference and actor get a line only when they
    took ``min_seconds`` or more (advantages, the sampler's old log-probs: instant).
    """

    def __init__(self, *, stream: Any = None, min_seconds: float = 0.05) -> None:
        self.stream = stream
        self.min_seconds = min_seconds
        self.t0 = time.perf_counter()
        self.total = 0
        self.start_step = 0

    def _say(self, text: str) -> None:
        print(text, file=self.stream if self.stream is not None else sys.stderr, flush=True)

    def start(self, *, total_steps: int, start_step: int, out_dir: str) -> None:
        self.t0 = time.perf_counter()
        self.total, self.start_step = total_steps, start_step
        self._say(f"training steps {start_step}..{total_steps - 1} -> {out_dir}")

    def phase_done(self, step: int, name: str, seconds: float) -> None:
        if seconds >= self.min_seconds or name in ("rollout", "teacher", "reference", "actor"):
            label = PHASE_LABELS.get(name, name)
            self._say(f"[{clock(time.perf_counter() - self.t0)}] step {step} {label}: {seconds:.1f} s")

    def step_done(self, step: int, record: Mapping[str, Any]) -> None:
        elapsed = time.perf_counter() - self.t0
        done = step + 1 - self.start_step
        left = self.total - step - 1
        eta = f", ETA {clock(elapsed / done * left)}" if done > 0 and left > 0 else ""
        self._say(f"[{clock(elapsed)}] {summary_line(step, record)}{eta}")

    def message(self, text: str) -> None:
        self._say(text)


def summary_line(step: int, r: Mapping[str, Any]) -> str:
    def f(key: str, fmt: str = ".3f") -> str:
        v = r.get(key)
        return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

    return (f"step {step}: success {f('rollout/success', '.2f')} score {f('rollout/score')} "
            f"invalid {f('rollout/invalid_rate', '.2f')} kl {f('actor/kl', '.2e')} clip {f('actor/clip_frac', '.3f')} "
            f"aux {f('actor/aux_loss', '.2e')} tcm {f('alloc/tcm')}{_tcm_why(r)} ({f('time/step', '.1f')} s)")


def _tcm_why(r: Mapping[str, Any]) -> str:
    """Why the step's TCM is n/a, when it is: no token with delta > 0 and a non-zero influence."""
    v = r.get("alloc/tcm")
    if r.get("alloc/tcm_active_tokens") == 0 and (v is None or (isinstance(v, float) and not math.isfinite(v))):
        return " (no token with delta > 0 and |u| > eps)"
    return ""
