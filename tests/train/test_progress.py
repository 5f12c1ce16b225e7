"""Progress output (issue 15): per-phase lines with elapsed time when stderr is a log, never wrapped."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

from icsd_audit.train.run.metrics import PrintReporter, clock


def test_clock() -> None:
    assert [clock(s) for s in (0, 59.4, 61, 3600, 3723)] == ["0:00", "0:59", "1:01", "1:00:00", "1:02:03"]


def test_print_reporter_lines() -> None:
    out = io.StringIO()
    rep = PrintReporter(stream=out)
    rep.start(total_steps=3, start_step=0, out_dir="runs/x")
    rep.phase_done(0, "rollout", 12.34)
    rep.phase_done(0, "advantages", 0.001)  # instant: no line
    rep.phase_done(0, "actor", 5.0)
    rep.step_done(0, {"rollout/success": 0.5, "time/step": 17.3})
    rep.message("x" * 300)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[0:00] training steps 0..2 -> runs/x"  # the clock of the whole command
    assert re.fullmatch(r"\[0:00\] step 0 rollout: 12\.3 s", lines[1]), lines[1]
    assert re.fullmatch(r"\[0:00\] step 0 actor update: 5\.0 s", lines[2]), lines[2]
    assert lines[3].startswith("[0:00] step 0: success 0.50") and re.search(r", ETA \d+:\d\d$", lines[3])
    assert lines[4] == "x" * 300 and len(lines) == 5  # whole, not wrapped


def test_piped_train_prints_one_line_per_phase(tmp_path: Path) -> None:
    sets = ["model=tiny-random", "n_tasks=1", "group_size=2", "max_turns=1", "max_response_tokens=4",
            "max_prompt_tokens=128", "mini_batch_rows=2", "micro_batch_rows=2", "sketch_k=0", "threads=1"]
    cmd = [sys.executable, "-m", "icsd_audit.cli", "train", "--preset", "cpu-demo", "--steps", "1",
           "--out", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # stderr is a pipe, not a terminal
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    for phase in ("rollout", "teacher pass", "reference pass", "actor update"):
        assert any(re.fullmatch(rf"\[\d+:\d\d\] step 0 {phase}: \d+\.\d s", ln) for ln in lines), (phase, lines)
    assert any(ln.startswith("done: steps 0..0; metrics ") for ln in lines)
    assert not any("\r" in ln or "it/s]" in ln for ln in lines)  # no progress bars in a log
