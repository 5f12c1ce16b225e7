"""The README's tables of the clue study, from `icsd compare --json` on the shipped runs.

Usage: python tables.py [SHIP_DIR]   (default: the runs/ folder beside this file)

Three tables, every number two decimals of what `icsd compare ... --json` prints (tests/runs/test_clue_study.py
recomputes them with the command and compares):

* per clue accuracy and metric (held-out success at the final evaluation; the logged step TCM, mean of the last
  50 updates that have one), each allocator's runs, mean and IQM with their 95 % intervals over runs;
* per clue accuracy and metric, ICSD against SDAR: difference of means and P(ICSD > SDAR), with intervals;
* per allocator, the logged TCM at clue accuracy 0.4 against 1.0 (grouped by clue_accuracy).

A value without an interval (one run in the group) shows ``-`` for its bounds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: (metric, extra compare options) of the per-accuracy tables.
METRICS = (("eval/success", ()), ("alloc/tcm", ("--last", "50")))


def compare(paths: list[Path], metric: str, *options: str) -> dict:
    cmd = [sys.executable, "-m", "icsd_audit.cli", "compare", *map(str, paths), "--metric", metric, *options, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def interval(stat: dict) -> str:
    lo, hi = stat["ci_low"], stat["ci_high"]
    bounds = "-, -" if lo is None else f"{lo:.2f}, {hi:.2f}"
    return f"{stat['estimate']:.2f} [{bounds}]"


def runs_of(ship: Path, acc: str) -> list[Path]:
    return sorted((ship / f"acc{acc}").glob("*-seed*"))


def accuracies(ship: Path) -> list[str]:
    return sorted((p.name[3:] for p in ship.glob("acc*") if p.is_dir()), reverse=True)


def main(ship: Path) -> None:
    groups = ["| clue accuracy | metric | allocator | runs | mean [95 % CI] | IQM [95 % CI] |", "|---|---|---|---|---|---|"]
    pairs = ["| clue accuracy | metric | x − y | mean x − mean y [95 % CI] | P(x > y) [95 % CI] |", "|---|---|---|---|---|"]
    for acc in accuracies(ship):
        for metric, opts in METRICS:
            d = compare(runs_of(ship, acc), metric, *opts, "--baseline", "sdar")
            for g in d["groups"]:
                groups.append(f"| {acc} | {metric} | {g['label']} | {g['n_runs']} | {interval(g['mean'])} | "
                              f"{interval(g['iqm'])} |")
            for c in d["comparisons"]:
                pairs.append(f"| {acc} | {metric} | {c['x']} − {c['y']} | {interval(c['difference_of_means'])} | "
                             f"{interval(c['probability_of_improvement'])} |")
    dial = ["| allocator | metric | runs at 0.4, 1.0 | TCM 0.4 − TCM 1.0 [95 % CI] | P(TCM 0.4 > TCM 1.0) [95 % CI] |",
            "|---|---|---|---|---|"]
    for alloc in ("opsd", "sdar", "icsd"):
        paths = [p for acc in ("0.4", "1.0") for p in runs_of(ship, acc) if p.name.startswith(f"{alloc}-seed")]
        if not paths:
            continue
        d = compare(paths, "alloc/tcm", "--last", "50", "--group-by", "clue_accuracy")
        n = {g["label"]: g["n_runs"] for g in d["groups"]}
        for c in d["comparisons"]:
            if {c["x"], c["y"]} == {"0.4", "1.0"}:
                sign = 1 if c["x"] == "0.4" else -1
                diff = dict(c["difference_of_means"])
                if sign < 0:  # the pair came the other way round: 0.4 - 1.0 is its negative
                    diff = {**diff, "estimate": -diff["estimate"],
                            "ci_low": None if diff["ci_high"] is None else -diff["ci_high"],
                            "ci_high": None if diff["ci_low"] is None else -diff["ci_low"]}
                pi = dict(c["probability_of_improvement"])
                if sign < 0:
                    pi = {**pi, "estimate": 1 - pi["estimate"],
                          "ci_low": None if pi["ci_high"] is None else 1 - pi["ci_high"],
                          "ci_high": None if pi["ci_low"] is None else 1 - pi["ci_low"]}
                dial.append(f"| {alloc} | alloc/tcm | {n.get('0.4', 0)}, {n.get('1.0', 0)} | {interval(diff)} | "
                            f"{interval(pi)} |")
    print("\n".join(groups) + "\n\n" + "\n".join(pairs) + "\n\n" + "\n".join(dial))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "runs")
