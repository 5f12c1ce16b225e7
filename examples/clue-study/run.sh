#!/usr/bin/env bash
# The clue study: GRPO, GRPO+OPSD, GRPO+SDAR, GRPO+ICSD x clue accuracy {1.0, 0.7, 0.4} x seeds, each run
# `icsd train --env clue` with its defaults (the tiny word model from random init, preset cpu-demo-clue),
# JOBS runs at a time with one torch thread each; then `icsd compare` per clue accuracy: held-out success and
# the mechanism (TCM, recomputed from the dumps) by allocator.
# Usage: examples/clue-study/run.sh OUT_DIR [STEPS] [SEEDS] [ACCURACIES] [JOBS]
#        (defaults: 200 steps, seeds "0 1 2 3 4 5 6 7 8 9", accuracies "1.0 0.7 0.4", 2 jobs)
# A run that finished is skipped, so the script resumes a study that was stopped.
set -euo pipefail
out=${1:?usage: run.sh OUT_DIR [STEPS] [SEEDS] [ACCURACIES] [JOBS]}
steps=${2:-200}
seeds=${3:-0 1 2 3 4 5 6 7 8 9}
accs=${4:-1.0 0.7 0.4}
jobs=${5:-2}
mkdir -p "$out"
for acc in $accs; do
  for seed in $seeds; do
    for alloc in none opsd sdar icsd; do
      echo "$acc $alloc $seed"
    done
  done
done | xargs -P "$jobs" -L 1 bash -c '
  run='"$out"'/acc$0/$1-seed$2
  [ -f "$run/eval.jsonl" ] && [ "$(wc -l < "$run/eval.jsonl")" -ge 1 ] && grep -q "\"step\": $(('"$steps"' - 1))," "$run/metrics.jsonl" && exit 0
  mkdir -p "$(dirname "$run")"
  /usr/bin/time -f "%e s wall, %U s user" -o "$run.time" env ICSD_THREADS=1 icsd train --env clue --allocator "$1" \
    --seed "$2" --steps '"$steps"' --set clue_accuracy="$0" --plain --overwrite --out "$run" > "$run.log" 2>&1'
for acc in $accs; do
  d="$out/acc$acc"
  icsd compare "$d"/*-seed*/ --metric eval/success --baseline none | tee "$d/compare-success.txt"
  # alloc/tcm is logged only on updates whose last mini-batch had conflict tokens: the --dumps comparison below
  # recomputes the mechanism from every dump; this table is the logged value's, where 20 updates logged it
  icsd compare "$d"/{opsd,sdar,icsd}-seed*/ --metric alloc/tcm --last 20 | tee "$d/compare-tcm.txt" || true
  icsd compare "$d"/*-seed*/ --metric eval/success --baseline none --curves eval/success,alloc/tcm,alloc/tcm_trust \
    --dumps --out "$d/compare"
done
