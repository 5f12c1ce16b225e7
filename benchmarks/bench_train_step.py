"""Step-time breakdown of the training loop: rollout, teacher, reference, actor, allocation, dump.

Usage:
  python benchmarks/bench_train_step.py --preset cpu-demo --steps 3 --out /tmp/icsd-bench
      runs the preset (any ``--set key=value`` override) and summarises its metrics;
  python benchmarks/bench_train_step.py --metrics runs/cpu-demo/metrics.jsonl
      summarises an existing run's metrics.jsonl instead.

Every step's record carries wall-clock seconds per phase (``time/*``). Printed: the
mean over steps (and over steps >= 1, since step 0 pays one-off warm-ups such as the
BM25 index), each phase's share of the step, and the allocation's share of the actor
update (the ICSD overhead: the paper reports 1.7 % per token on H100s; the target
here is under 1 %). ``time/actor`` is the whole update (ratio pre-pass + allocation +
gradient micro-batches + optimizer), dump writing excluded; ``time/prepass`` and
``time/allocation`` are parts of it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

PHASES = [
    ("rollout", "rollout (generate + env)"),
    ("old_logp", "old log-prob pass"),
    ("teacher", "teacher pass"),
    ("reference", "reference pass"),
    ("actor", "actor update (total)"),
    ("prepass", "  of which ratio pre-pass"),
    ("allocation", "  of which allocation"),
    ("actor_grad", "  of which grad micro-batches + optimizer"),
    ("dump", "dump writing"),
    ("advantages", "advantages"),
    ("step", "step (wall)"),
]


def summarise(records: list[dict]) -> dict:
    def mean(key: str, recs: list[dict]) -> float:
        vals = [r.get(f"time/{key}", 0.0) or 0.0 for r in recs]
        return sum(vals) / len(vals) if vals else float("nan")

    out: dict = {"steps": len(records), "all": {}, "after_first": {}}
    for label, recs in (("all", records), ("after_first", records[1:])):
        for key, _ in PHASES:
            out[label][key] = mean(key, recs)
        a = out[label]
        a["allocation_share_of_actor"] = a["allocation"] / a["actor"] if a.get("actor") else float("nan")
        a["prepass_share_of_actor"] = a["prepass"] / a["actor"] if a.get("actor") else float("nan")
    out["tokens_per_step"] = sum(r.get("actor/tokens", 0) for r in records) / max(len(records), 1)
    out["rows_per_step"] = sum(r.get("rollout/rows", 0) for r in records) / max(len(records), 1)
    return out


def print_table(s: dict) -> None:
    print(f"steps: {s['steps']}; rows/step {s['rows_per_step']:.1f}; actor tokens/step {s['tokens_per_step']:.0f}")
    print(f"{'phase':44s} {'mean s (all)':>13s} {'share':>7s} {'mean s (>=1)':>13s}")
    step_all = s["all"]["step"] or float("nan")
    for key, label in PHASES:
        a = s["all"][key]
        b = s["after_first"].get(key, float("nan"))
        print(f"{label:44s} {a:13.3f} {a / step_all:7.1%} {b:13.3f}")
    for label in ("all", "after_first"):
        x = s[label]
        print(f"[{label}] allocation / actor update = {x['allocation_share_of_actor']:.4%}; "
              f"ratio pre-pass / actor update = {x['prepass_share_of_actor']:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metrics", type=Path, help="summarise this metrics.jsonl instead of running")
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/icsd-bench-train"))
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override key=value")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()

    if args.metrics is None:
        import torch

        from icsd_audit.train.config import TrainConfig, from_preset, parse_override
        from icsd_audit.train.loop import train
        from icsd_audit.train.run.metrics import PrintReporter

        overrides = dict(parse_override(s) for s in args.sets)
        cfg = from_preset(args.preset, out_dir=str(args.out), total_steps=args.steps, **overrides)
        t0 = time.perf_counter()
        train(cfg, reporter=PrintReporter())
        wall = time.perf_counter() - t0
        metrics = args.out / "metrics.jsonl"
        print(f"run wall time {wall:.1f} s (model load, checkpoint and eval included); torch threads "
              f"{torch.get_num_threads()}; {platform.processor() or platform.machine()}")
    else:
        metrics = args.metrics
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    if not records:
        sys.exit(f"{metrics} holds no step records")
    s = summarise(records)
    s["metrics"] = str(metrics)
    print_table(s)
    if args.json:
        args.json.write_text(json.dumps(s, indent=2) + "\n")


if __name__ == "__main__":
    main()
