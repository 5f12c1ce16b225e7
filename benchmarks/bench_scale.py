"""Benchmark: the audit as a map over batches and a reduce (``icsd audit ... --backend local|ray``).

Map: one batch read, allocated (SDAR and ICSD) and reduced to per-turn sums
(:func:`icsd_audit.audit.ray_backend.batch_part`, what a Ray task runs), on synthetic
dumps (:func:`icsd_audit.dumps.synth.synth_tokens`, one shard per batch): tokens per
second in this process, then on a local Ray cluster of each ``--ray-workers`` count
(tokens per second in all and per worker, after one warm-up task per worker, and each
worker's peak RSS). Reduce: the driver's merge of one part per batch
(:meth:`AuditAccumulator.merge`) and the bootstrap of TCM over the merged turns, for
each ``--reduce-batches`` count (each batch ``--reduce-turns`` turns of 40 tokens;
parts built without allocation, their build time not counted).

    python benchmarks/bench_scale.py
    python benchmarks/bench_scale.py --tokens 400000 --batches 20 --ray-workers 1 2 \\
        --reduce-batches 10 100 1000 10000 --reduce-turns 20 --resamples 1000
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np


def write_synth(out: Path, n_tokens: int, n_batches: int) -> None:
    from icsd_audit.dumps.synth import synth_tokens
    from icsd_audit.dumps.writer import DumpWriter

    cols = synth_tokens(n_tokens, n_batches=n_batches, seed=0)
    w = DumpWriter(out, producer="bench_scale", synthetic=True)
    for b in range(n_batches):
        sel = cols["batch_id"] == b
        w.write(**{k: v[sel] for k, v in cols.items()})


def _timed_part(paths: list[str], req: object, stats: tuple[str, ...], b: int) -> tuple[object, int]:
    from icsd_audit.audit.ray_backend import batch_part

    part = batch_part(paths, req, stats, b)
    return part, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_map(paths: list[str], ray_workers: list[int]) -> None:
    from icsd_audit.audit.ray_backend import batch_part
    from icsd_audit.audit.run import deployed_request
    from icsd_audit.dumps.reader import DumpReader

    req = dataclasses.replace(deployed_request(paths), n_resamples=1)
    reader = DumpReader(paths)
    ids, n_tok = reader.batch_ids, reader.n_rows
    stats = ("tcm",)
    batch_part(paths, req, stats, ids[0])  # warm: imports, the worker's reader
    t = time.perf_counter()
    for b in ids:
        batch_part(paths, req, stats, b)
    dt = time.perf_counter() - t
    print(f"map, this process: {len(ids)} batches, {n_tok} tokens in {dt:.2f} s: {n_tok / dt:,.0f} tokens/s")
    if not ray_workers:
        return
    import ray

    for w in ray_workers:
        t0 = time.perf_counter()
        ray.init(num_cpus=w, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
                 log_to_driver=False)
        task = ray.remote(num_cpus=1, max_retries=0)(_timed_part)
        ray.get([task.remote(paths, req, stats, ids[i % len(ids)]) for i in range(w)])  # one warm-up per worker
        start = time.perf_counter() - t0
        t = time.perf_counter()
        out = ray.get([task.remote(paths, req, stats, b) for b in ids])
        dt = time.perf_counter() - t
        rss = max(r for _, r in out)
        print(f"map, Ray {w} worker(s): {n_tok / dt:,.0f} tokens/s ({n_tok / dt / w:,.0f} per worker), "
              f"peak worker RSS {rss / 2**20:.0f} MiB; cluster start + warm-up {start:.1f} s")
        ray.shutdown()


def bench_reduce(batch_counts: list[int], turns: int, n_resamples: int) -> None:
    from icsd_audit.stats.accumulator import AuditAccumulator
    from icsd_audit.stats.api import Weights
    from icsd_audit.tokens import Tokens

    rng = np.random.default_rng(0)
    for nb in batch_counts:
        parts = []
        for b in range(nb):
            n = turns * 40
            turn = np.repeat(np.arange(turns), 40)
            cols = dict(batch_id=np.full(n, b), traj_id=turn // 4, turn_id=turn % 4,
                        advantage=np.repeat(rng.normal(size=turns), 40), ratio=np.ones(n),
                        delta=rng.normal(0.1, 1.0, n), valid=np.ones(n, bool))
            part = AuditAccumulator(statistics=("tcm",))
            part.add(Tokens.from_mapping(cols), Weights(rng.random(n), rng.random(n)))
            parts.append(part)
        t = time.perf_counter()
        acc = AuditAccumulator(statistics=("tcm",))
        for p in parts:
            acc.merge(p)
        merged = time.perf_counter() - t
        t = time.perf_counter()
        acc.finalize(n_resamples=n_resamples, rng=0)
        boot = time.perf_counter() - t
        print(f"reduce, {nb} batches ({nb * turns} turns): merge {merged:.3f} s ({merged / nb * 1e6:.0f} us/batch), "
              f"bootstrap of {n_resamples} resamples {boot:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=400_000)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--ray-workers", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--reduce-batches", type=int, nargs="*", default=[10, 100, 1000, 10000])
    ap.add_argument("--reduce-turns", type=int, default=20)
    ap.add_argument("--resamples", type=int, default=1000)
    args = ap.parse_args()
    print(f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dumps"
        write_synth(out, args.tokens, args.batches)
        bench_map([str(out)], args.ray_workers)
    bench_reduce(args.reduce_batches, args.reduce_turns, args.resamples)
    print(f"load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
