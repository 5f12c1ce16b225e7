#!/usr/bin/env bash
# examples/cpu-learn: one longer run of the cpu-study preset from the shipped WebShop warm start, with a greedy
# evaluation on 10 held-out tasks every 6 steps, and the warm start's own evaluation on the same tasks.
# One torch thread each, so that the two fit on a 2-core machine side by side.
# Usage: examples/cpu-learn/run.sh OUT_DIR [STEPS]   (default: 24 steps)
set -euo pipefail
out=${1:?usage: run.sh OUT_DIR [STEPS]}
steps=${2:-24}
mkdir -p "$out"
ICSD_THREADS=1 icsd eval --adapter warmstart:webshop-smollm2-135m --preset cpu-study --tasks 10 --temperature 0 \
  --out "$out/warmstart-eval.json" > "$out/warmstart-eval.log" 2>&1 &
ICSD_THREADS=1 icsd train --env webshop --preset cpu-study --steps "$steps" --set eval_every=6 --set eval_tasks=10 \
  --set eval_temperature=0 --out "$out/run" --plain > "$out/train.log" 2>&1
wait
icsd compare "$out/run" --metric eval/score --last 1 --curves rollout/score,eval/score,rollout/invalid_rate,alloc/tcm \
  --out "$out/compare"
