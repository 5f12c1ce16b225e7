"""Real short training runs for the compare and tracker tests: ``python -m tests.runs.tiny_runs OUT [TRACKERS]``.

Four built-in-loop runs of the tiny random model (SDAR and ICSD, seeds 0 and 1, two steps
each) on WebShop with varied rewards (so advantages, the allocation and TCM are not
degenerate), into ``OUT/{sdar,icsd}-{0,1}``; ``OUT/icsd-0`` also reports to TRACKERS
(comma-separated).  Run in a process of its own because trackers read their stores'
locations from the environment when imported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from icsd_audit.train.loop import train
from tests.train.test_loop import SKILLS, tiny_cfg, varied_factory


def main(out: Path, trackers: str = "") -> None:
    bank = out / "bank.json"
    out.mkdir(parents=True, exist_ok=True)
    bank.write_text(json.dumps(SKILLS))
    for alloc in ("sdar", "icsd"):
        for seed in (0, 1):
            report = trackers if (alloc, seed) == ("icsd", 0) else ""
            cfg = tiny_cfg(out / f"{alloc}-{seed}", str(bank), allocator=alloc, seed=seed, total_steps=2,
                           report_to=report)
            train(cfg, env_factory=varied_factory())


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")
