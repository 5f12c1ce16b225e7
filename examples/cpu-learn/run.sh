#!/usr/bin/env bash
# examples/cpu-learn: a longer run of the cpu-study preset from the shipped WebShop warm start, with a greedy
# evaluation on 10 held-out tasks every 6 steps, beside the warm start's own evaluation on the same tasks.
# One torch thread each, so that two fit on a 2-core machine side by side.
# Usage: examples/cpu-learn/run.sh OUT_DIR [STEPS] [SEED]   (defaults: 24 steps, seed 0)
set -euo pipefail
out=${1:?usage: run.sh OUT_DIR [STEPS] [SEED]}
steps=${2:-24}
seed=${3:-0}
mkdir -p "$out"
if [ ! -e "$out/warmstart-eval.json" ]; then
  ICSD_THREADS=1 icsd eval --adapter warmstart:webshop-smollm2-135m --preset cpu-study --tasks 10 --temperature 0 \
    --out "$out/warmstart-eval.json" > "$out/warmstart-eval.log" 2>&1 &
fi
ICSD_THREADS=1 icsd train --env webshop --preset cpu-study --seed "$seed" --steps "$steps" --set eval_every=6 \
  --set eval_tasks=10 --set eval_temperature=0 --out "$out/seed$seed" --plain > "$out/seed$seed.log" 2>&1
wait
icsd compare "$out"/seed*/ --metric eval/score --last 1 --curves rollout/score,eval/score,rollout/invalid_rate,alloc/tcm \
  --out "$out/compare"
