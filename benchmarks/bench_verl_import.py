"""What the icsd verl plug-in adds to ``import verl`` (paid by every verl process, every Ray worker included).

Usage: python benchmarks/bench_verl_import.py [--repeats 5] [--statement "import verl"]

1. Runs ``python -c STATEMENT`` in fresh processes, alternating ``VERL_USE_EXTERNAL_PLUGINS=none``
   (no plug-in) and ``auto`` (ours loaded), and prints each wall time and CPU time (user +
   system of the child), the medians and their differences, with the 1-minute load average
   before and after (wall times move with the machine's load: say it with them; CPU times
   much less).
2. In fresh processes that ``import verl`` with no plug-in, times loading the plug-in as verl
   does (``entry_points(group="verl.plugins")``, then ``ep.load()``): what it adds, without
   the noise of two whole imports.
3. Prints which of the plug-in's registrations STATEMENT ran (none for a plain ``import verl``).

``--statement`` times something else, e.g. a registry lookup that makes the plug-in register
(``"from verl.trainer.ppo.v1 import get_trainer_cls"``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

#: verl with no plug-in, then the plug-in loaded as verl/__init__.py loads it, timed
_LOAD = """import time, verl
from importlib.metadata import entry_points
t0 = time.perf_counter()
for ep in entry_points(group="verl.plugins"):
    if ep.name == "icsd":
        ep.load()
print(time.perf_counter() - t0)
"""


def _env(plugins: str) -> dict[str, str]:
    return {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": plugins, "PYTHONWARNINGS": "ignore"}


def _run(statement: str, plugins: str) -> tuple[float, float]:
    """(wall, CPU) seconds of ``python -c statement`` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], env=_env(plugins), check=True, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--statement", default="import verl")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    _run(args.statement, "auto")  # warm the file cache (bytecode, metadata) once, untimed
    times: dict[str, list[tuple[float, float]]] = {"none": [], "auto": []}
    for _ in range(args.repeats):
        for plugins in ("none", "auto"):
            times[plugins].append(_run(args.statement, plugins))
    load1 = os.getloadavg()[0]
    med = {p: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for p, ts in times.items()}
    for plugins, ts in times.items():
        print(f"VERL_USE_EXTERNAL_PLUGINS={plugins}: wall " + " ".join(f"{t[0]:.2f}" for t in ts)
              + f" s (median {med[plugins][0]:.2f}); CPU " + " ".join(f"{t[1]:.2f}" for t in ts)
              + f" s (median {med[plugins][1]:.2f})")
    print(f"the plug-in adds {med['auto'][0] - med['none'][0]:+.2f} s wall, {med['auto'][1] - med['none'][1]:+.2f} s "
          f"CPU (medians of {args.repeats}) to `{args.statement}`; load average {load0:.2f} before, {load1:.2f} after")
    loads = []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, check=True,
                             env=_env("none"))
        loads.append(float(out.stdout.strip().splitlines()[-1]))
    print("loading the plug-in as verl does, after `import verl`: " + " ".join(f"{t:.3f}" for t in loads)
          + f" s (median {statistics.median(loads):.3f} s)")
    probe = (f"{args.statement}\nimport sys\nm = sys.modules.get('icsd_audit.integrations.verl.plugin')\n"
             "print(sorted(m.registered()) if m and hasattr(m, 'registered') else 'no registered() to ask')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env("auto"))
    print(f"registrations run by `{args.statement}`: {out.stdout.strip() or out.stderr.strip()[-300:]}")


if __name__ == "__main__":
    main()
