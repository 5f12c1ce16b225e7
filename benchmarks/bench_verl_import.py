"""What the icsd verl plug-in adds to ``import verl`` (paid by every verl process, every Ray worker included).

Usage: python benchmarks/bench_verl_import.py [--repeats 5] [--statement "import verl"]

Runs ``python -c STATEMENT`` in fresh processes, alternating ``VERL_USE_EXTERNAL_PLUGINS=none``
(no plug-in) and ``auto`` (ours loaded), and prints each wall time, the medians, their
difference and the 1-minute load average before and after (the figures move with the
machine's load: say it with them).  ``--statement`` times something else, e.g. a registry
lookup that makes the plug-in register (``"from verl.trainer.ppo.v1 import get_trainer_cls"``).
Also prints which of the plug-in's registrations ran (none for a plain ``import verl``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _run(statement: str, plugins: str) -> float:
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": plugins, "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--statement", default="import verl")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    _run(args.statement, "auto")  # warm the file cache (bytecode, metadata) once, untimed
    times: dict[str, list[float]] = {"none": [], "auto": []}
    for _ in range(args.repeats):
        for plugins in ("none", "auto"):
            times[plugins].append(_run(args.statement, plugins))
    load1 = os.getloadavg()[0]
    for plugins, ts in times.items():
        print(f"VERL_USE_EXTERNAL_PLUGINS={plugins}: " + " ".join(f"{t:.2f}" for t in ts)
              + f" s; median {statistics.median(ts):.2f} s")
    added = statistics.median(times["auto"]) - statistics.median(times["none"])
    print(f"the plug-in adds {added:+.2f} s (median of {args.repeats}) to `{args.statement}`; "
          f"load average {load0:.2f} before, {load1:.2f} after")
    # the plug-in's own share, measured inside one process (less at the mercy of the load than wall times)
    imp = subprocess.run([sys.executable, "-X", "importtime", "-c", args.statement], capture_output=True, text=True,
                         env={**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "auto", "PYTHONWARNINGS": "ignore"})
    own = [int(line.split("|")[1]) for line in imp.stderr.splitlines()
           if line.startswith("import time:") and line.split("|")[-1].strip() == "icsd_audit.integrations.verl"]
    print(f"import of the plug-in module inside `{args.statement}` (python -X importtime, cumulative): "
          + (f"{own[0] / 1e6:.3f} s" if own else "not imported"))
    probe = (f"{args.statement}\nimport sys\nm = sys.modules.get('icsd_audit.integrations.verl')\n"
             "print(sorted(m.registered()) if m else 'plug-in not loaded')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "auto", "PYTHONWARNINGS": "ignore"})
    print(f"registrations run by `{args.statement}`: {out.stdout.strip() or out.stderr.strip()[-300:]}")


if __name__ == "__main__":
    main()
