#!/usr/bin/env bash
# The clue study: GRPO, GRPO+OPSD, GRPO+SDAR, GRPO+ICSD x clue accuracy {1.0, 0.7, 0.4} x seeds, each run
# `icsd train --env clue` with its defaults (preset cpu-demo-clue: the tiny word model, 200 updates), JOBS runs
# at a time with one torch thread each (nice 5). Seeds are the outer loop, so a study stopped early holds
# whole seeds of every cell. Dumps: only the SDAR runs of seed 0 at accuracies 0.4 and 1.0 write them (every
# 10th update), for `icsd audit report`; every other run writes metrics.jsonl, eval.jsonl, run.json and
# config.json only (a dump changes no trained number).
# Then ship.py copies each finished run (metrics.jsonl cut to the keys the comparison reads) into SHIP and
# `icsd compare` scores the shipped runs per clue accuracy: held-out success and the logged TCM by allocator.
# ICSD (default: icsd) is the command run, e.g. ICSD="python -m icsd_audit.cli" with PYTHONPATH naming a frozen copy
# of the package, so that editing the working tree does not change a study under way.
# Usage: examples/clue-study/run.sh OUT_DIR [SHIP_DIR] [STEPS] [SEEDS] [ACCURACIES] [ALLOCATORS] [JOBS]
#        (defaults: SHIP_DIR examples/clue-study/runs, 200 steps, seeds "0 1 2 3 4 5 6 7 8 9",
#         accuracies "1.0 0.4 0.7" and allocators "sdar icsd none opsd", in that order, 2 jobs)
# A run that finished is skipped, so the script resumes a study that was stopped.
set -euo pipefail
icsd=${ICSD:-icsd}
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: run.sh OUT_DIR [SHIP_DIR] [STEPS] [SEEDS] [ACCURACIES] [JOBS]}
ship=${2:-$here/runs}
steps=${3:-200}
seeds=${4:-0 1 2 3 4 5 6 7 8 9}
accs=${5:-1.0 0.4 0.7}
allocs=${6:-sdar icsd none opsd}
jobs=${7:-2}
mkdir -p "$out"
start=$(date +%s)
uptime > "$out/load-start.txt"
for seed in $seeds; do
  for acc in $accs; do
    for alloc in $allocs; do
      echo "$acc $alloc $seed"
    done
  done
done | xargs -P "$jobs" -L 1 bash -c '
  run='"$out"'/acc$0/$1-seed$2
  [ -f "$run/metrics.jsonl" ] && grep -q "\"step\": $(('"$steps"' - 1))," "$run/metrics.jsonl" && exit 0
  dump=0
  [ "$1" = sdar ] && [ "$2" = 0 ] && { [ "$0" = 0.4 ] || [ "$0" = 1.0 ]; } && dump=10
  mkdir -p "$(dirname "$run")"
  /usr/bin/time -f "%e s wall, %U s user, %S s system" -o "$run.time" nice -n 5 env ICSD_THREADS=1 '"$icsd"' train \
    --env clue --allocator "$1" --seed "$2" --steps '"$steps"' --set clue_accuracy="$0" --set dump_every=$dump \
    --plain --overwrite --out "$run" > "$run.log" 2>&1 || echo "failed: $run (see $run.log)" >&2'
echo "$(( $(date +%s) - start )) s wall" > "$out/wall.txt"
uptime > "$out/load-end.txt"
python "$here/ship.py" "$out" "$ship"
for acc in $accs; do
  d="$ship/acc$acc"
  [ -d "$d" ] || continue
  $icsd compare "$d"/*-seed*/ --metric eval/success --baseline sdar | tee "$d/compare-success.txt"
  $icsd compare "$d"/*-seed*/ --metric eval/success --baseline sdar --json > "$d/compare-success.json"
  # TCM: the mean of each run's logged step TCM over its last 50 updates (steps without an active token log none)
  # (runs without distillation log no TCM: compare names them as left out)
  $icsd compare "$d"/*-seed*/ --metric alloc/tcm --last 50 --baseline sdar | tee "$d/compare-tcm.txt"
  $icsd compare "$d"/*-seed*/ --metric alloc/tcm --last 50 --baseline sdar --json > "$d/compare-tcm.json"
  $icsd compare "$d"/*-seed*/ --metric eval/success --baseline sdar --curves eval/success,alloc/tcm,alloc/tcm_trust \
    --out "$d/compare" > /dev/null
done
# the audited SDAR runs: all 20 dumped updates (0, 10, ..., 190), and the first five (0 to 40), while RL has not
# yet worn away the teacher's reading of the clue; their dumps are shipped too
for acc in 0.4 1.0; do
  d="$out/acc$acc/sdar-seed0/dumps"
  [ -d "$d" ] || continue
  $icsd audit report "$d" --out "$(dirname "$ship")/audit-sdar-acc$acc"
  $icsd audit report "$d"/step0000{00,10,20,30,40} --out "$(dirname "$ship")/audit-sdar-acc$acc-first41"
  cp -r "$d" "$ship/acc$acc/sdar-seed0/dumps"
done
