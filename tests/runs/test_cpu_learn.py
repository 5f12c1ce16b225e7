"""examples/cpu-learn: the shipped runs are what its README says (settings, evaluations, the held-out table)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.runs.conftest import ROOT

LEARN = ROOT / "examples" / "cpu-learn"


def runs() -> list[Path]:
    return sorted(p for p in LEARN.iterdir() if p.is_dir() and re.fullmatch(r"seed\d+", p.name))


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_runs_continue_the_warm_start_with_a_greedy_evaluation_every_6_steps():
    assert len(runs()) >= 2
    for run in runs():
        config = json.loads((run / "config.json").read_text())
        manifest = json.loads((run / "run.json").read_text())
        assert config["init"] == "warmstart:webshop-smollm2-135m" and config["seed"] == int(run.name[4:])
        assert (config["n_tasks"], config["group_size"], config["max_turns"], config["allocator"]) == (1, 3, 5, "icsd")
        assert (config["eval_every"], config["eval_tasks"], config["eval_temperature"]) == (6, 10, 0.0)
        assert manifest["status"] == "finished" and manifest["completed_steps"] == len(records(run))
        evaluated = [r["step"] for r in records(run) if "eval/score" in r]
        assert evaluated == [s for s in range(len(records(run))) if (s + 1) % 6 == 0 or s == len(records(run)) - 1]
        assert all(r["eval/n_tasks"] == 10 for r in records(run) if "eval/score" in r)


def test_the_warm_start_was_evaluated_on_the_same_tasks_greedily():
    ev = json.loads((LEARN / "warmstart-eval.json").read_text())
    assert ev["adapter"] == "warmstart:webshop-smollm2-135m" and ev["split"] == "eval" and ev["n_tasks"] == 10


def test_the_readme_table_is_the_evaluations():
    """Each held-out row of the README ('| updates | seed | success | score | invalid | turns |') equals the files."""
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      (LEARN / "README.md").read_text(), flags=re.M)
    want = set()
    ws = json.loads((LEARN / "warmstart-eval.json").read_text())
    for run in runs():
        want.add((0, int(run.name[4:]), ws["success"], ws["score"], ws["invalid_rate"], ws["turns"]))
        for r in records(run):
            if "eval/score" in r:
                want.add((r["step"] + 1, int(run.name[4:]), r["eval/success"], r["eval/score"], r["eval/invalid_rate"],
                          r["eval/turns"]))
    got = {(int(u), int(s), float(a), float(b), float(c), float(d)) for u, s, a, b, c, d in rows}
    assert len(got) == len(want) == len(rows)
    for w in want:
        assert any(g[:2] == w[:2] and all(abs(x - y) <= 0.0005 for x, y in zip(g[2:], w[2:])) for g in got), w
