"""What a long command shows while it runs: a live bar on a terminal, whole lines in a log.

* :class:`RichReporter`: the training loop's reporter on a terminal (steps done, the
  running phase and the actor's mini-batch, elapsed time, and an ETA from the measured
  step times: rich's own estimate samples only the last 30 s of progress, so with
  steps of minutes it showed ``-:--:--`` for the whole run).
* :func:`routed_logs`: the library's INFO lines (model conversion and loading, with
  their times) and transformers' warnings go through the reporter as whole lines, above
  the bar or into the log, instead of being written to stderr behind its back.
* :func:`silence_bars`: third-party progress bars (tqdm in transformers' GGUF
  conversion and ``Writing model shards``, Hugging Face's own) are switched off; on a
  terminal they tore the live bar, in a log they were one line of carriage returns.

rich is imported on first use only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from typing import Any, Iterator, Mapping

from .common import stderr_console

__all__ = ["RichReporter", "routed_logs", "silence_bars", "eta_text"]


def silence_bars() -> None:
    """Switch off tqdm and Hugging Face progress bars for this process and its children.

    tqdm reads ``TQDM_DISABLE`` once, when it is imported, and ``import torch`` imports it
    (``torch.hub``): in a command that had imported torch before this call, the variable
    alone left the GGUF conversion's bar on (832 characters of carriage returns in a
    piped log).  So a tqdm already imported gets ``disable=True`` as its default here;
    a caller that passes ``disable`` itself still decides.
    """
    os.environ.setdefault("TQDM_DISABLE", "1")  # this process's later import of tqdm, and child processes
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    std = sys.modules.get("tqdm.std")
    if std is not None and os.environ["TQDM_DISABLE"] == "1" and not getattr(std.tqdm, "_icsd_silenced", False):
        std.tqdm.__init__ = functools.partialmethod(std.tqdm.__dict__["__init__"], disable=True)
        std.tqdm._icsd_silenced = True
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # no [train] extra: nothing of theirs will draw a bar
        return
    hf_logging.disable_progress_bar()


class _ToReporter(logging.Handler):
    """A logging handler that hands each record to the reporter as one whole line."""

    def __init__(self, reporter: Any) -> None:
        super().__init__(logging.INFO)
        self.reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = " ".join(record.getMessage().split())
            if record.levelno >= logging.WARNING:
                text = f"warning ({record.name.split('.')[0]}): {text}"
            event = getattr(self.reporter, "event", None)
            if event is not None:
                event(text, running=bool(getattr(record, "running", False)))
            else:
                self.reporter.message(text)
        except Exception:  # a progress line must never break the run
            self.handleError(record)


@contextlib.contextmanager
def routed_logs(reporter: Any) -> Iterator[None]:
    """Within the block: ``icsd_audit`` INFO records and ``transformers`` warnings go to ``reporter``.

    transformers' own stderr handler is switched off meanwhile (restored after), so its
    warnings appear once, as whole lines, never inside a bar's redraw.
    """
    handler = _ToReporter(reporter)
    ours = logging.getLogger("icsd_audit")
    theirs = logging.getLogger("transformers")  # its own level (WARNING by default) still filters
    saved = (ours.level, ours.propagate, theirs.propagate, list(theirs.handlers))
    ours.setLevel(logging.INFO)
    ours.propagate = False
    ours.addHandler(handler)
    theirs.handlers = [handler]
    theirs.propagate = False
    try:
        yield
    finally:
        ours.removeHandler(handler)
        ours.setLevel(saved[0])
        ours.propagate = saved[1]
        theirs.propagate = saved[2]
        theirs.handlers = saved[3]


def eta_text(step_seconds: list[float], steps_left: int, in_step: float) -> str:
    """The ETA from measured steps: mean step time x steps left, less the time already in this step."""
    if steps_left <= 0:
        return "ETA 0:00"
    if not step_seconds:
        return "ETA after the first step"
    from icsd_audit.train.run.metrics import clock

    return f"ETA {clock(max(sum(step_seconds) / len(step_seconds) * steps_left - in_step, 0.0))}"


class RichReporter:
    """A live bar for terminals: steps done, the running phase (and mini-batch), elapsed time, ETA.

    The ETA is the mean time of the steps finished so far times the steps left, less the
    time spent in the running step ("after the first step" until one is done); each
    finished step prints its summary line above the bar, unwrapped, and so do messages
    and the library's timed lines (model conversion and loading).
    """

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        owner = self

        class _Eta(ProgressColumn):  # type: ignore[misc]
            def render(self, task: Any) -> Text:
                return Text(owner.eta(), style="progress.remaining")

        self.console = stderr_console()
        self.bar = Progress(TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.description}"), TimeElapsedColumn(), _Eta(), console=self.console)
        self.task: Any = None
        self.total = 0
        self.next_step = 0
        self.step_seconds: list[float] = []
        self.step_t0 = time.perf_counter()
        self.phase_label = ""

    def eta(self) -> str:
        return eta_text(self.step_seconds, self.total - self.next_step, time.perf_counter() - self.step_t0)

    def start(self, *, total_steps: int, start_step: int, out_dir: str) -> None:
        self.console.print(f"training steps {start_step}..{total_steps - 1} -> [bold]{out_dir}[/]", soft_wrap=True)
        self.total, self.next_step, self.step_t0 = total_steps, start_step, time.perf_counter()
        self.bar.start()
        self.task = self.bar.add_task("starting", total=total_steps, completed=start_step)

    def phase(self, step: int, name: str) -> None:
        from icsd_audit.train.run.metrics import PHASE_LABELS

        self.phase_label = PHASE_LABELS.get(name, name)
        self.bar.update(self.task, description=f"step {step}: {self.phase_label}")

    def phase_done(self, step: int, name: str, seconds: float) -> None:
        return None

    def progress(self, step: int, name: str, done: int, total: int, unit: str) -> None:
        self.bar.update(self.task, description=f"step {step}: {self.phase_label}, {unit} {done}/{total} done")

    def step_done(self, step: int, record: Mapping[str, Any]) -> None:
        from icsd_audit.train.run.metrics import summary_line

        now = time.perf_counter()
        self.step_seconds.append(now - self.step_t0)
        self.step_t0, self.next_step = now, step + 1
        self.bar.console.print(summary_line(step, record), highlight=False, soft_wrap=True)
        self.bar.update(self.task, completed=step + 1)

    def message(self, text: str) -> None:
        self.bar.console.print(text, highlight=False, soft_wrap=True)

    def event(self, text: str, *, running: bool = False) -> None:
        self.message(text)

    @contextlib.contextmanager
    def keepalive(self) -> Iterator["RichReporter"]:
        """The live bar redraws itself: nothing to add (the log reporter's keep-alive lines)."""
        yield self

    def finish(self) -> None:
        self.bar.stop()
