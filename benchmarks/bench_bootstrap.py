"""Benchmark: action-turn bootstrap of TCM + quadrant shares at the paper's evidence scale.

Synthesizes ~2.2M valid tokens in 4 batches (~40k action turns; turn-constant
advantages, ICSD-like weights with turn mass matching), streams them batch by batch
(synthesized one at a time, as a dump reader yields them) into
:class:`icsd_audit.stats.api.AuditAccumulator`, and bootstraps 10,000 resamples.  Prints
wall times of the per-turn reduction and of the bootstrap, the peak memory traced by
Python's allocator hooks (numpy arrays included) during the streamed audit, and the
process's peak RSS.

    python benchmarks/bench_bootstrap.py
    python benchmarks/bench_bootstrap.py --tokens 2200000 --batches 4 --turns 40000 --resamples 10000 --stats tcm quadrants
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
import tracemalloc

import numpy as np


def synth_batch(rng: np.random.Generator, b: int, n_tokens: int, n_turns: int) -> dict[str, np.ndarray]:
    """One batch: turns of ~n_tokens/n_turns tokens, 8 turns per trajectory."""
    lengths = 1 + rng.poisson(n_tokens / n_turns - 1, n_turns)
    n = int(lengths.sum())
    turn_idx = np.repeat(np.arange(n_turns), lengths)
    traj = (turn_idx // 8).astype(np.int64)
    turn = (turn_idx % 8).astype(np.int32)
    adv_turn = np.where(rng.random(n_turns) < 0.1, 0.0, rng.normal(0, 1, n_turns)).astype(np.float32)
    adv = adv_turn[turn_idx]
    delta = rng.normal(0.1, 1.0, n).astype(np.float32)
    ratio = (1 + 0.03 * rng.standard_normal(n)).astype(np.float32)
    g = 1 / (1 + np.exp(-5 * delta.astype(np.float64)))
    m = rng.random(n)
    D = (adv < 0) & (delta < 0)
    sg = np.bincount(turn_idx, weights=np.where(D, 0.0, g), minlength=n_turns)
    sgm = np.bincount(turn_idx, weights=np.where(D, 0.0, g * m), minlength=n_turns)
    alpha = np.where(sgm > 1e-4, sg / np.maximum(sgm, 1e-300), np.nan)[turn_idx]
    c = np.where(D | np.isnan(alpha), g, alpha * g * m)
    return dict(delta=delta, advantage=adv, ratio=ratio, base=g, compare=c, traj_id=traj, turn_id=turn,
                batch_id=np.full(n, b, dtype=np.int64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2_200_000)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--turns", type=int, default=40_000)
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--stats", nargs="+", default=["tcm", "quadrants"])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-memory", action="store_true", help="skip the traced-memory run")
    args = ap.parse_args()

    from icsd_audit.stats.api import AuditAccumulator
    from icsd_audit.tokens import Tokens, Weights

    def batches():
        """The batches, synthesized one at a time (a dump reader's access pattern)."""
        rng = np.random.default_rng(args.seed)
        for b in range(args.batches):
            yield synth_batch(rng, b, args.tokens // args.batches, args.turns // args.batches)

    def audit():
        acc = AuditAccumulator(statistics=tuple(args.stats))
        t_add = 0.0
        n_tok = 0
        for x in batches():
            t = time.perf_counter()
            acc.add(Tokens(**{k: v for k, v in x.items() if k not in ('base', 'compare')}),
                    Weights(x['base'], x['compare']))
            t_add += time.perf_counter() - t
            n_tok += x["delta"].size
        t1, c1 = time.perf_counter(), time.process_time()
        res = acc.finalize(n_resamples=args.resamples, rng=args.seed, workers=args.workers)
        audit.cpu = time.process_time() - c1
        return acc, res, t_add, time.perf_counter() - t1, n_tok

    # timing run (no allocation tracing: tracemalloc slows numpy allocations)
    acc, res, t_add, t_boot, n_tok = audit()
    cpu_boot = audit.cpu
    # memory run: the same audit under tracemalloc (numpy reports its buffers to it);
    # the peak includes the one synthesized batch held at a time
    peak = None
    if not args.no_memory:
        tracemalloc.start()
        audit()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()

    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    print(f"tokens {n_tok:,} | batches {args.batches} | action turns {acc._n_clusters:,} | statistics {' + '.join(acc.statistics)}")
    print(f"per-turn reduction (AuditAccumulator.add, all batches)  {t_add:8.3f} s")
    print(f"bootstrap (finalize: {args.resamples:,} resamples, workers={args.workers})  {t_boot:8.3f} s"
          f"  (CPU {cpu_boot:.3f} s)")
    print(f"total audit (synthesis excluded)                        {t_add + t_boot:8.3f} s")
    if peak is not None:
        print(f"peak traced memory of the streamed audit  {peak / 2**20:8.1f} MiB")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak RSS of the process                   {rss / (2**20 if sys.platform == 'darwin' else 2**10):8.1f} MiB")
    if res.tcm is not None:
        t = res.tcm
        print(f"TCM {t.base_name} {t.base.estimate:.4f} [{t.base.ci_low:.4f}, {t.base.ci_high:.4f}]  "
              f"{t.compare_name} {t.compare.estimate:.4f} [{t.compare.ci_low:.4f}, {t.compare.ci_high:.4f}]  "
              f"diff {t.diff.estimate:+.4f} [{t.diff.ci_low:+.4f}, {t.diff.ci_high:+.4f}]")


if __name__ == "__main__":
    main()
