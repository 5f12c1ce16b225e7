"""Peak RSS of ``icsd train`` (the README's main job by default), measured on a child process.

Usage:
    python benchmarks/bench_train_memory.py                       # the full cpu-demo, ~10 min on 2 idle cores
    python benchmarks/bench_train_memory.py --steps 1             # one step (the peak is reached in step 0)
    python benchmarks/bench_train_memory.py --steps 1 --savers-off  # without the three savers
    python benchmarks/bench_train_memory.py --fresh-cache         # include the first-run GGUF conversion

The training command runs under a small wrapper that waits for it and prints
``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``: the same figure as ``/usr/bin/time -v``'s
"Maximum resident set size" (the high-water mark of the process's resident memory,
file-backed pages included). ``--savers-off`` turns off the three memory savers of
:mod:`icsd_audit.train.models.memory` (activation recomputation, the per-pass reference, the
optimizer spill), which change no number; the fixed mmap threshold stays on (it is
process-wide, set by ``train``), so this is not quite the pre-issue-15 trainer. Run it alone: the machine's load average is
printed with the figures because a shared machine stretches the wall time (not the peak).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_WRAP = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
         "stderr=subprocess.DEVNULL); print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")

SAVERS_OFF = ("recompute_activations=false", "resident_reference=true", "spill_optimizer_state=false")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra --set key=value (repeatable)")
    ap.add_argument("--savers-off", action="store_true", help="turn the three memory savers off")
    ap.add_argument("--fresh-cache", action="store_true", help="use an empty model cache (counts the GGUF conversion)")
    ap.add_argument("--out", type=Path, default=None, help="run folder (default: a temporary one)")
    args = ap.parse_args()

    env = dict(os.environ)
    env.setdefault("ICSD_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "run"
        if args.fresh_cache:
            env["ICSD_CACHE"] = str(Path(tmp) / "cache")
        cmd = [sys.executable, "-m", "icsd_audit.cli", "train", "--env", "webshop", "--preset", args.preset,
               "--out", str(out)]
        if args.steps is not None:
            cmd += ["--steps", str(args.steps)]
        for s in [*args.sets, *(SAVERS_OFF if args.savers_off else ())]:
            cmd += ["--set", s]
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", _WRAP, *cmd], check=True, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        rc, peak_kib = (int(x) for x in res.stdout.split()[-2:])
    if rc != 0:
        sys.exit(f"icsd train exited {rc}: {' '.join(cmd)}")
    print(f"icsd train --preset {args.preset}" + (f" --steps {args.steps}" if args.steps is not None else "")
          + (" (memory savers off)" if args.savers_off else "") + (" (fresh model cache)" if args.fresh_cache else ""))
    print(f"peak RSS : {peak_kib / 1024**2:6.2f} GiB ({peak_kib / 1024:,.0f} MiB)")
    print(f"wall     : {wall / 60:6.1f} min   load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end"
          f" (ICSD_THREADS={env['ICSD_THREADS']})")


if __name__ == "__main__":
    main()
