"""Copy the clue study's finished runs into the shipped example, metrics cut to the keys the comparison reads.

Usage: python ship.py OUT_DIR SHIP_DIR

Every run folder OUT_DIR/accA/NAME whose metrics.jsonl reaches its config's last step is copied to
SHIP_DIR/accA/NAME: config.json, run.json and eval.jsonl as they are, metrics.jsonl with each record cut to
``step`` and the keys in KEEP (the full record holds about 80 keys, 120 runs of it would be some 60 MB), and
the run's `/usr/bin/time` line (NAME.time, beside the folder) as time.txt. A run that did not finish is
named on stderr and left out. SHIP_DIR must not hold runs already (an output never replaces an input).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

#: metrics.jsonl keys kept: held-out evaluation, the mechanism per step, rollout success and the step's time.
KEEP = ("eval/", "alloc/tcm", "alloc/share", "rollout/success", "rollout/invalid_rate", "time/step")


def finished(run: Path) -> bool:
    try:
        last = json.loads((run / "config.json").read_text())["total_steps"] - 1
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except (OSError, ValueError, KeyError):
        return False
    return bool(lines) and json.loads(lines[-1]).get("step") == last


def main(out: Path, ship: Path) -> int:
    if ship.exists() and any(ship.glob("acc*/*-seed*")):
        print(f"{ship}: already holds runs; ship into an empty folder", file=sys.stderr)
        return 2
    copied = 0
    for run in sorted(out.glob("acc*/*-seed*")):
        if not run.is_dir():
            continue
        if not finished(run):
            print(f"left out (not finished): {run}", file=sys.stderr)
            continue
        dest = ship / run.parent.name / run.name
        dest.mkdir(parents=True)
        for name in ("config.json", "run.json", "eval.jsonl"):
            if (run / name).is_file():
                shutil.copyfile(run / name, dest / name)
        with open(run / "metrics.jsonl") as src, open(dest / "metrics.jsonl", "w") as dst:
            for line in src:
                rec = json.loads(line)
                cut = {k: v for k, v in rec.items() if k == "step" or k.startswith(KEEP)}
                dst.write(json.dumps(cut) + "\n")
        timing = run.parent / f"{run.name}.time"
        if timing.is_file():
            shutil.copyfile(timing, dest / "time.txt")
        copied += 1
    print(f"shipped {copied} runs to {ship}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
