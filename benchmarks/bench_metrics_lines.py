"""``icsd compare --metric X`` on a run whose metrics.jsonl holds one huge line: time and peak RSS.

Usage: python benchmarks/bench_metrics_lines.py [--keys 4000000,780000]

For each key count, writes a run folder whose metrics.jsonl has one record of that many
numeric keys besides ``X`` (about 19 bytes per key: 4M keys make a 76 MB line, over the
16 MiB limit per line; 780k keys a 14.8 MB line, under it) and a second small record, then
runs ``icsd compare RUN --metric X`` under ``/usr/bin/time -v``. Prints the exit code, the
wall time, the peak resident set size and the command's error line, if any.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--keys", default="4000000,780000")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.keys.split(",")):
            run = Path(tmp) / f"keys{n}"
            run.mkdir()
            (run / "config.json").write_text(json.dumps({"allocator": "icsd", "seed": 0, "env": "webshop"}))
            with (run / "metrics.jsonl").open("w") as fh:
                fh.write('{"step": 0, "X": 0.25, ' + ", ".join(f'"k{i:07d}": 0.123' for i in range(n)) + "}\n")
                fh.write('{"step": 1, "X": 0.5}\n')
            size = (run / "metrics.jsonl").stat().st_size
            res = subprocess.run(["/usr/bin/time", "-v", "icsd", "compare", str(run), "--metric", "X"],
                                 capture_output=True, text=True)
            wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", res.stderr).group(1)
            rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr).group(1))
            err = next((ln for ln in res.stderr.splitlines() if ln.startswith("error:")), "")
            print(f"{n:>9,} keys, {size / 1e6:6.1f} MB line: exit {res.returncode}, wall {wall}, "
                  f"peak RSS {rss / 1024:,.0f} MiB {err.replace(str(run), 'RUN')}")


if __name__ == "__main__":
    main()
