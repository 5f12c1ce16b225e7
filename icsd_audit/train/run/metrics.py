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

import contextlib
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

import numpy as np

from icsd_audit.alloc.settings import DEFAULTS

__all__ = ["kept_lines", "MetricsLog", "Reporter", "NullReporter", "PrintReporter", "step_tcm", "clean", "clock", "summary_line"]


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


def kept_lines(path: str | Path, start_step: int) -> list[str]:
    """The lines of a run's JSONL log that a run resumed at ``start_step`` keeps (those of earlier steps).

    Read without writing, so a resume checks its logs before it changes anything: a
    file that is not UTF-8, or a record whose ``step`` is not an integer, is refused
    (ValueError naming the file and line); a torn last line (a crash mid-write) is dropped.
    """
    f = Path(path)
    try:
        lines = f.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{f}: not a UTF-8 JSONL log (byte {exc.start}); move the file aside to resume") from None
    kept = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except RecursionError:
            raise ValueError(f"{f}: line {i} is nested too deeply to be a metrics record") from None
        except ValueError:
            if i == len(lines):
                continue  # a torn last line from a crash
            raise ValueError(f"{f}: line {i} is not JSON; move the file aside to resume") from None
        step = rec.get("step") if isinstance(rec, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{f}: line {i}: step is {step!r}, not an integer step number")
        if step < start_step:
            kept.append(line)
    return kept


class MetricsLog:
    """Append-only JSONL, one record per step, flushed at once."""

    def __init__(self, path: str | Path, *, start_step: int = 0):
        from icsd_audit.outputs import write_text_atomic

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = kept_lines(self.path, start_step)
            write_text_atomic(self.path, "".join(k + "\n" for k in kept))

    def write(self, record: Mapping[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(clean(record), sort_keys=True) + "\n")
            fh.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def step_tcm(arrays: Mapping[str, np.ndarray], eps: float = DEFAULTS.eps) -> dict[str, float]:
    """TCM and sign-region shares (SPEC 6) of one step's deployed tokens under the trust g and the coefficient c.

    Keys: ``tcm`` / ``tcm_trust`` (under c / g), ``tcm_active_tokens``, and ``share/REGION`` /
    ``share_trust/REGION`` for the regions of :data:`icsd_audit.stats.results.REGIONS`
    (the per-step mechanism trajectory ``icsd compare`` draws).  Point estimates only
    (``icsd audit tcm|quadrants`` add bootstrap intervals); computed by
    :func:`icsd_audit.stats.api.tcm` and :func:`~icsd_audit.stats.api.quadrants` with one
    resample, so the definitions live in one place.

    The arrays pool every mini-batch of the step. A step without an active token (none with
    delta > 0 and |u| > eps: all advantages 0, or a policy so sure of its tokens that student and
    teacher log-probs are both 0 in float32) has no TCM (0 / 0): ``tcm`` and ``tcm_trust`` are then
    left out, with ``tcm_active_tokens`` 0, rather than logged as NaN (JSON null), so that a
    window of steps (``icsd compare --last K``) averages the steps that have one.
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
        out["tcm_active_tokens"] = 0.0
    out = {k: v for k, v in out.items() if k == "tcm_active_tokens" or np.isfinite(v)}
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

    def progress(self, step: int, name: str, done: int, total: int, unit: str) -> None:
        """``done`` of ``total`` units (``unit``: "mini-batch") of phase ``name`` are finished."""
        ...

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

    def progress(self, step: int, name: str, done: int, total: int, unit: str) -> None:
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
    """Plain lines on stderr for logs, never quiet for long.

    One line per phase (with its time and the time since the command started), one per
    finished actor mini-batch, one summary per step with an ETA from the mean time of the
    steps finished so far; :meth:`event` lines (model conversion and loading) carry the
    same clock. Inside :meth:`keepalive`, a line saying what is running and for how long
    is written whenever ``quiet_seconds`` pass without one (a long rollout, a GGUF
    conversion), so a log never looks hung.

    Lines are written whole (one ``write`` each, under a lock) and never wrapped,
    whatever the width. Other phases than rollout, teacher, reference and actor get a
    line only when they took ``min_seconds`` or more (advantages, the sampler's old
    log-probs: instant).
    """

    def __init__(self, *, stream: Any = None, min_seconds: float = 0.05, quiet_seconds: float = 25.0,
                 now: Callable[[], float] = time.perf_counter) -> None:
        self.stream = stream
        self.min_seconds = min_seconds
        self.quiet_seconds = quiet_seconds
        self._now = now  # injectable, so that tests need no wall-clock waits
        self.t0 = self._now()  # the clock of every line: time since the command started
        self.train_t0 = self.t0  # the ETA's: time since training started
        self.total = 0
        self.start_step = 0
        self._lock = threading.Lock()
        self._last_line = self.t0
        self._activity, self._since, self._done = "setting up", self.t0, ""
        self._outer: tuple[str, float, str] | None = None  # what ran before the current running event

    def _say(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        with self._lock:
            stream.write(text + "\n")  # one write: a keep-alive line never splits another
            stream.flush()
            self._last_line = self._now()

    def _clock(self) -> str:
        return f"[{clock(self._now() - self.t0)}]"

    def _doing(self, activity: str) -> None:
        self._activity, self._since, self._done = activity, self._now(), ""

    def start(self, *, total_steps: int, start_step: int, out_dir: str) -> None:
        self.train_t0 = self._now()
        self.total, self.start_step = total_steps, start_step
        self._say(f"{self._clock()} training steps {start_step}..{total_steps - 1} -> {out_dir}")
        self._doing(f"step {start_step}")

    def phase(self, step: int, name: str) -> None:
        self._doing(f"step {step} {PHASE_LABELS.get(name, name)}")

    def phase_done(self, step: int, name: str, seconds: float) -> None:
        if seconds >= self.min_seconds or name in ("rollout", "teacher", "reference", "actor"):
            label = PHASE_LABELS.get(name, name)
            self._say(f"{self._clock()} step {step} {label}: {seconds:.1f} s")
        self._doing(f"step {step}")

    def progress(self, step: int, name: str, done: int, total: int, unit: str) -> None:
        self._done = f"{unit} {done}/{total} done"
        self._say(f"{self._clock()} step {step} {PHASE_LABELS.get(name, name)}: {unit} {done}/{total} "
                  f"({self._now() - self._since:.1f} s)")

    def step_done(self, step: int, record: Mapping[str, Any]) -> None:
        elapsed = self._now() - self.train_t0
        done = step + 1 - self.start_step
        left = self.total - step - 1
        eta = f", ETA {clock(elapsed / done * left)}" if done > 0 and left > 0 else ""
        self._say(f"{self._clock()} {summary_line(step, record)}{eta}")
        self._doing(f"step {step + 1}" if left > 0 else "finishing")

    def message(self, text: str) -> None:
        self._say(text)

    def event(self, text: str, *, running: bool = False) -> None:
        """A timed line (model conversion, loading). ``running``: it starts something that keep-alive
        lines name until the next event (``converting ...`` until ``converted ... in 48.1 s``)."""
        self._say(f"{self._clock()} {text}")
        if running:
            self._outer = (self._activity, self._since, self._done)
            self._doing(text)
        elif self._outer is not None:
            self._activity, self._since, self._done = self._outer
            self._outer = None

    def check_quiet(self) -> None:
        """After ``quiet_seconds`` without a line: one saying what runs and for how long (the keep-alive's tick)."""
        now = self._now()
        if now - self._last_line >= self.quiet_seconds:
            done = f", {self._done}" if self._done else ""
            self._say(f"[{clock(now - self.t0)}] {self._activity}: running for {clock(now - self._since)}{done}")

    @contextlib.contextmanager
    def keepalive(self) -> Iterator["PrintReporter"]:
        """Within the block, a line every ``quiet_seconds`` without one: what runs, for how long."""
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(min(1.0, self.quiet_seconds / 4)):
                self.check_quiet()

        thread = threading.Thread(target=watch, name="icsd-keepalive", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()


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
