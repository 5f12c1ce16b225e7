#!/usr/bin/env bash
# The runs of examples/cpu-study: GRPO, GRPO+SDAR, GRPO+ICSD x seeds, from the shipped WebShop
# warm start (preset cpu-study), two runs at a time with one torch thread each, then the comparison.
# Usage: examples/cpu-study/run.sh OUT_DIR [STEPS] [SEEDS]   (defaults: 2 steps, seeds "0 1 2")
set -euo pipefail
out=${1:?usage: run.sh OUT_DIR [STEPS] [SEEDS]}
steps=${2:-2}
seeds=${3:-0 1 2}
mkdir -p "$out"
for seed in $seeds; do
  for alloc in none sdar icsd; do
    echo "$alloc $seed"
  done
done | xargs -P 2 -L 1 bash -c 'ICSD_THREADS=1 icsd train --env webshop --preset cpu-study --adv grpo \
  --allocator "$0" --seed "$1" --steps '"$steps"' --plain --out '"$out"'/"$0"-seed"$1" > '"$out"'/"$0"-seed"$1".log 2>&1'
cd "$out"
for metric in rollout/score rollout/invalid_rate; do
  icsd compare *-seed*/ --metric "$metric" --last 1 | tee "compare-${metric#rollout/}.txt"
done
icsd compare *-seed*/ --metric rollout/score --last 1 --curves rollout/invalid_rate,alloc/tcm,alloc/tcm_trust --out compare
