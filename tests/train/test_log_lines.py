"""A training log that never goes quiet and never floods: timed whole lines, keep-alive lines in silences."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from icsd_audit.cli.progress import eta_text, routed_logs
from icsd_audit.train.run.metrics import PrintReporter

CLOCK = r"\[\d+:\d\d\]"


class FakeClock:
    """A clock the test moves by hand: the reporter reads it instead of the wall clock."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def wait(self, rep: PrintReporter, seconds: float, tick: float = 0.05) -> None:
        """``seconds`` pass, the keep-alive looking every ``tick``."""
        for _ in range(round(seconds / tick)):
            self.t += tick
            rep.check_quiet()


def test_keepalive_names_what_runs_when_nothing_else_was_said() -> None:
    out, now = io.StringIO(), FakeClock()
    rep = PrintReporter(stream=out, quiet_seconds=0.2, now=now)
    rep.event("converting the embedded model (once per cache)", running=True)
    now.wait(rep, 0.75)
    rep.event("converted the embedded model in 0.7 s")
    rep.start(total_steps=2, start_step=0, out_dir="runs/x")
    rep.phase(0, "actor")
    rep.progress(0, "actor", 1, 4, "mini-batch")
    now.wait(rep, 0.75)
    lines = out.getvalue().split("\n")
    assert lines[-1] == "" and all("\r" not in ln for ln in lines)
    conv = [ln for ln in lines if re.fullmatch(rf"{CLOCK} converting the embedded model \(once per cache\): running for 0:0\d", ln)]
    assert len(conv) == 3, lines  # one every 0.2 s of silence (0.2, 0.4, 0.6 s), none after the conversion ended
    actor = [ln for ln in lines if re.fullmatch(rf"{CLOCK} step 0 actor update: running for 0:0\d, mini-batch 1/4 done", ln)]
    assert len(actor) == 3, lines
    i_conv = next(i for i, ln in enumerate(lines) if re.fullmatch(rf"{CLOCK} converted the embedded model in 0.7 s", ln))
    assert all("converting" not in ln for ln in lines[i_conv + 1:])
    assert re.fullmatch(rf"{CLOCK} step 0 actor update: mini-batch 1/4 \(\d+\.\d s\)", lines[i_conv + 2]), lines


def test_no_keepalive_line_while_lines_keep_coming() -> None:
    out, now = io.StringIO(), FakeClock()
    rep = PrintReporter(stream=out, quiet_seconds=0.5, now=now)
    rep.phase(0, "rollout")
    for _ in range(8):
        now.wait(rep, 0.1)
        rep.message("busy")
    assert "running for" not in out.getvalue()
    now.wait(rep, 0.6)  # then a silence: the line comes
    assert out.getvalue().count("running for") == 1


def test_the_keepalive_thread_stops_with_its_block() -> None:
    import threading

    rep = PrintReporter(stream=io.StringIO(), quiet_seconds=0.2)
    with rep.keepalive():
        assert any(t.name == "icsd-keepalive" for t in threading.enumerate())
    assert not any(t.name == "icsd-keepalive" for t in threading.enumerate())


def test_eta_from_measured_steps() -> None:
    assert eta_text([], 2, 5.0) == "ETA after the first step"
    assert eta_text([100.0, 120.0], 2, 30.0) == "ETA 3:10"  # 110 s x 2 steps left - 30 s into this one
    assert eta_text([100.0], 1, 250.0) == "ETA 0:00"  # a slow step: never negative
    assert eta_text([100.0], 0, 0.0) == "ETA 0:00"


def test_library_lines_and_transformers_warnings_go_through_the_reporter() -> None:
    out = io.StringIO()
    rep = PrintReporter(stream=out)
    before = list(logging.getLogger("transformers").handlers)
    with routed_logs(rep):
        logging.getLogger("icsd_audit.train.models.loading").info("loaded model x in %.1f s", 1.25)
        logging.getLogger("icsd_audit.train.models.loading").debug("not shown")
        logging.getLogger("transformers.generation").warning("a warning\nover two lines")
    assert logging.getLogger("transformers").handlers == before
    assert out.getvalue().splitlines() == ["[0:00] loaded model x in 1.2 s",
                                           "[0:00] warning (transformers): a warning over two lines"]


def test_third_party_bars_are_silenced() -> None:
    code = ("from icsd_audit.cli.progress import silence_bars; silence_bars()\n"
            "from tqdm.auto import tqdm\nfor _ in tqdm(range(50), desc='Writing model shards'): pass\n"
            "from transformers.utils import logging as hf; assert not hf.is_progress_bar_enabled()")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Writing model shards" not in res.stderr and "\r" not in res.stderr


def test_bars_stay_silenced_when_torch_imported_tqdm_first() -> None:
    # the CLI imports torch (which imports tqdm via torch.hub) before it loads a model: the GGUF
    # conversion's bar (transformers' tqdm.auto) was then one long line of carriage returns in a log
    code = ("import sys, torch\nassert 'tqdm.std' in sys.modules\n"
            "from icsd_audit.cli.progress import silence_bars; silence_bars(); silence_bars()\n"
            "from tqdm.auto import tqdm\n"
            "for _ in tqdm(range(50), desc='Converting and de-quantizing GGUF tensors...'): pass\n"
            "import io\nsys.stderr.write('own bar:' + str(tqdm(range(1), disable=False, file=io.StringIO()).disable))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("TQDM_")})
    assert res.returncode == 0, res.stderr
    assert "Converting" not in res.stderr and "\r" not in res.stderr, res.stderr
    assert "own bar:False" in res.stderr  # a caller that asks for its bar still gets it


def test_piped_log_has_a_line_per_mini_batch_and_no_carriage_returns(tmp_path: Path) -> None:
    sets = ["model=tiny-random", "n_tasks=1", "group_size=3", "max_turns=1", "max_response_tokens=4",
            "max_prompt_tokens=128", "mini_batch_rows=1", "micro_batch_rows=1", "sketch_k=0", "threads=1"]
    cmd = [sys.executable, "-m", "icsd_audit.cli", "train", "--preset", "cpu-demo", "--steps", "2",
           "--out", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]]
    res = subprocess.run(cmd, capture_output=True, timeout=300)  # stderr is a pipe, not a terminal
    err = res.stderr.decode()
    assert res.returncode == 0, err
    assert "\r" not in err and "it/s" not in err  # no bar redraws in a log
    lines = err.splitlines()
    assert max(map(len, lines)) < 400, max(lines, key=len)
    assert re.fullmatch(rf"{CLOCK} loaded model tiny-random \(\S+ parameters\) in \d+\.\d s", lines[0]), lines[0]
    for step in (0, 1):
        for k in (1, 2, 3):  # 3 episodes x 1 turn = 3 rows, one per mini-batch
            pat = rf"{CLOCK} step {step} actor update: mini-batch {k}/3 \(\d+\.\d s\)"
            assert sum(bool(re.fullmatch(pat, ln)) for ln in lines) == 1, (pat, lines)
    assert lines[-4].startswith("done: steps 0..1; metrics ")
    assert lines[-3] == ("success here: the share of a step's 3 episodes (1 task x 3 rollouts, at most 1 turn each) "
                         "that bought a product that matches every requested attribute and option within the price "
                         "limit (reward 1; score is the reward's partial credit, 0 to 1).")
    import json

    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["rollout/success"] == 0  # a random tiny model wins nothing: the run says why
    assert lines[-2] == (f"why success is 0: in the last step {100 * last['rollout/invalid_rate']:.0f} % of the replies "
                         "were not a valid action, and an episode has at most 1 turn to finish its task; a run this "
                         "small shows where the distillation mass goes, not learning.")
    assert lines[-1].startswith(f"what to look at: icsd audit report {tmp_path / 'run' / 'dumps'} --out "
                                f"{tmp_path / 'run' / 'report'} ")


def test_why_success_is_zero_only_when_it_is() -> None:
    from types import SimpleNamespace

    from icsd_audit.cli.train import what_next

    cfg = SimpleNamespace(env="alfworld", n_tasks=2, group_size=4, max_turns=3, out_dir="run")
    assert len(what_next(cfg, None)) == 1  # no record (a run that never stepped): nothing to explain
    assert len(what_next(cfg, None, {"rollout/success": 0.125, "rollout/invalid_rate": 0.5})) == 1
    lines = what_next(cfg, Path("run/dumps"), {"rollout/success": 0.0, "rollout/invalid_rate": 0.8125})
    assert lines[0].endswith("(2 tasks x 4 rollouts, at most 3 turns each) that completed its household task.")
    assert lines[1].startswith("why success is 0: in the last step 81 % of the replies were not a valid action, and an "
                               "episode has at most 3 turns to finish its task;")
    assert lines[2].startswith("what to look at: icsd audit report run/dumps --out run/report ")
