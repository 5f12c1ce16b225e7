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
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np

__all__ = ["MetricsLog", "Reporter", "NullReporter", "PrintReporter", "step_tcm", "clean"]


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
            self.path.write_text("".join(k + "\n" for k in kept))

    def write(self, record: Mapping[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(clean(record), sort_keys=True) + "\n")
            fh.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def step_tcm(arrays: Mapping[str, np.ndarray], eps: float = 1e-4) -> dict[str, float]:
    """TCM (SPEC 6) of one step's deployed tokens under the trust g and the coefficient c.

    Point estimates only (``icsd audit tcm`` adds bootstrap intervals); computed by
    :func:`icsd_audit.stats.api.tcm` with one resample, so the definition lives in one place.
    """
    if not arrays or arrays.get("c") is None or np.asarray(arrays["c"]).size == 0:
        return {}
    from icsd_audit.stats.api import tcm
    from icsd_audit.tokens import Tokens, Weights

    a = {k: np.asarray(v) for k, v in arrays.items()}
    f64 = {k: a[k].astype(np.float64) for k in ("delta", "advantage", "ratio", "g", "c")}
    tokens = Tokens(advantage=f64["advantage"], ratio=f64["ratio"], delta=f64["delta"], traj_id=a["traj_id"],
                    turn_id=a["turn_id"], batch_id=a["batch_id"])
    try:
        res = tcm(tokens, Weights(f64["g"], f64["c"]), eps=eps, n_resamples=1, rng=0)
    except ValueError:
        return {"tcm": float("nan"), "tcm_trust": float("nan"), "tcm_active_tokens": 0.0}
    return {"tcm": float(res.compare.estimate), "tcm_trust": float(res.base.estimate),
            "tcm_active_tokens": float(res.n_active_tokens)}


class Reporter(Protocol):
    """What the training loop tells the outside world."""

    def start(self, *, total_steps: int, start_step: int, out_dir: str) -> None: ...

    def phase(self, step: int, name: str) -> None: ...

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

    def step_done(self, step: int, record: Mapping[str, Any]) -> None:
        return None

    def message(self, text: str) -> None:
        return None

    def finish(self) -> None:
        return None


class PrintReporter(NullReporter):
    """One plain line per step on stderr."""

    def start(self, *, total_steps: int, start_step: int, out_dir: str) -> None:
        print(f"training steps {start_step}..{total_steps - 1} -> {out_dir}", file=sys.stderr)

    def step_done(self, step: int, record: Mapping[str, Any]) -> None:
        print(summary_line(step, record), file=sys.stderr)

    def message(self, text: str) -> None:
        print(text, file=sys.stderr)


def summary_line(step: int, r: Mapping[str, Any]) -> str:
    def f(key: str, fmt: str = ".3f") -> str:
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

    return (f"step {step}: success {f('rollout/success', '.2f')} score {f('rollout/score')} "
            f"invalid {f('rollout/invalid_rate', '.2f')} kl {f('actor/kl', '.2e')} clip {f('actor/clip_frac', '.3f')} "
            f"aux {f('actor/aux_loss', '.2e')} tcm {f('alloc/tcm')} ({f('time/step', '.1f')} s)")
