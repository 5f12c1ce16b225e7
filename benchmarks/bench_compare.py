"""Time of ``icsd compare`` on many synthetic runs (the issue's target: 100 runs x 200 steps under 3 s).

Writes ``--runs`` run folders (two allocators, seeds 0..runs/2-1) of ``--steps`` logged steps
each, with records shaped like the built-in loop's (``--keys`` numeric keys per step, the
mechanism keys among them), into a temporary folder; then times loading, the comparison
(10,000 resamples), the curves (the metric and the 12 mechanism keys) and the whole command
as a user runs it (``python -m icsd_audit.cli compare DIR --metric ... --last 10``, with and
without ``--json``, which adds the curves; wall clock, interpreter start included).  Prints one line per figure.

    python benchmarks/bench_compare.py --runs 100 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_runs(root: Path, n_runs: int, steps: int, n_keys: int) -> None:
    from icsd_audit.runs.curves import MECHANISM_KEYS

    rng = np.random.default_rng(0)
    filler = [f"actor/k{i:02d}" for i in range(max(0, n_keys - len(MECHANISM_KEYS) - 1))]
    for r in range(n_runs):
        alloc = ("sdar", "icsd")[r % 2]
        folder = root / f"{alloc}-{r // 2}"
        folder.mkdir(parents=True)
        cfg = {"allocator": alloc, "env": "webshop", "seed": r // 2, "model": "embedded", "adv_estimator": "grpo",
               "lr": 1e-5, "out_dir": str(folder)}
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
        lines = []
        for s in range(steps):
            rec = {"step": s, "rollout/success": float(rng.random() < 0.3 + 0.001 * s + 0.05 * (alloc == "icsd"))}
            rec.update({k: float(rng.random()) for k in MECHANISM_KEYS})
            rec.update({k: float(rng.normal()) for k in filler})
            lines.append(json.dumps(rec, sort_keys=True))
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--keys", type=int, default=70, help="numeric keys per record (the built-in loop logs ~70)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from icsd_audit.runs.compare import compare_runs
    from icsd_audit.runs.curves import MECHANISM_KEYS, group_curves
    from icsd_audit.runs.folders import load_runs

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        make_runs(root, args.runs, args.steps, args.keys)
        size = sum(p.stat().st_size for p in root.rglob("metrics.jsonl"))
        print(f"{args.runs} runs x {args.steps} steps, {args.keys} keys per record, {size / 2**20:.1f} MiB of "
              f"metrics.jsonl; load average {os.getloadavg()[0]:.2f}")
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            wanted = {"rollout/success", *MECHANISM_KEYS}  # what `icsd compare --metric rollout/success` keeps
            runs, _ = load_runs([root], keys=lambda k: k in wanted or k.startswith("eval/subsets/"))
            t1 = time.perf_counter()
            c = compare_runs(runs, metric="rollout/success", last=10)
            t2 = time.perf_counter()
            by_name = {r.name: r for r in runs}
            group_curves(c.members, by_name, ["rollout/success", *MECHANISM_KEYS])
            t3 = time.perf_counter()
            cmd = [sys.executable, "-m", "icsd_audit.cli", "compare", str(root), "--metric", "rollout/success",
                   "--last", "10"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            t4 = time.perf_counter()
            assert res.returncode == 0, res.stderr
            res = subprocess.run(cmd + ["--json"], capture_output=True, text=True)
            t5 = time.perf_counter()
            assert res.returncode == 0, res.stderr
            for name, dt in (("load", t1 - t0), ("compare (10,000 resamples)", t2 - t1),
                             ("curves (13 keys, 2,000 resamples)", t3 - t2),
                             ("icsd compare ... (terminal table; wall, interpreter start included)", t4 - t3),
                             ("icsd compare ... --json (with the 13 keys' curves; wall)", t5 - t4)):
                best[name] = min(best.get(name, float("inf")), dt)
        for name, dt in best.items():
            print(f"{name}: {dt:.3f} s (best of {args.repeats})")
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
