"""Cost of the padded-batch wrapper (integrations.core.allocate_padded) over flat allocate.

Usage: python benchmarks/bench_integrations.py [--rows 512] [--tokens 512] [--threads 1] [--repeats 5]
One actor mini-batch of ``rows`` padded rows x ``tokens`` positions (verl-agent-like: one
turn per row, lengths uniform in [tokens/4, tokens], 8 rollouts x up to 8 turns per task),
icsd allocator on CPU.  Prints the median wall time of flat ``allocate`` on the same
tokens already in canonical order, and of ``allocate_padded`` (selection, canonical sort,
float32 rounding, scatter back, duplicate detection).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from icsd_audit.alloc.variants import allocate
from icsd_audit.integrations.core import allocate_padded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    B, T = args.rows, args.tokens
    lens = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T).view(1, -1) < lens.view(-1, 1)
    traj = torch.arange(B) // 8
    turn = torch.arange(B) % 8
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ratio = torch.exp(0.02 * torch.randn(B, T, generator=g, dtype=torch.float64))
    delta = torch.randn(B, T, generator=g, dtype=torch.float64)
    rows, cols = torch.nonzero(mask, as_tuple=True)  # row-major == canonical here (traj, turn ascending by row)
    flat = dict(advantage=adv[rows].float().double(), ratio=ratio[rows, cols].float().double(),
                delta=delta[rows, cols].float().double(), traj_id=traj[rows], turn_id=turn[rows])

    def timed(fn) -> float:
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    n = int(mask.sum())
    t_flat = timed(lambda: allocate(**flat))
    t_pad = timed(lambda: allocate_padded(advantage=adv, ratio=ratio, delta=delta, response_mask=mask, traj_id=traj,
                                          turn_id=turn))
    same = torch.equal(allocate_padded(advantage=adv, ratio=ratio, delta=delta, response_mask=mask, traj_id=traj,
                                       turn_id=turn).c[rows, cols], allocate(**flat).c)
    print(f"{B} rows x {T} positions, {n} valid tokens, threads={args.threads}")
    print(f"allocate (flat, canonical)  {t_flat * 1e3:8.1f} ms  {n / t_flat / 1e6:6.2f} M tokens/s")
    print(f"allocate_padded             {t_pad * 1e3:8.1f} ms  {n / t_pad / 1e6:6.2f} M tokens/s  (+{(t_pad / t_flat - 1) * 100:.0f} %)")
    print(f"identical c: {same}")


if __name__ == "__main__":
    main()
