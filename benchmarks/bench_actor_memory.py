"""Memory of one actor gradient micro-batch of the cpu-demo (SmolLM2-135M), saver by saver.

Usage: python benchmarks/bench_actor_memory.py [--rows 4] [--prompt 600] [--response 48]

Each configuration runs in a fresh process (the mmap threshold is process-wide): the
embedded model is loaded, a random micro-batch of ``rows`` prompts (``prompt`` tokens for
the longest, 37 fewer per row) and responses is packed as the actor packs it, the
response log-probs are computed and back-propagated. Printed: resident memory above the
loaded weights after the forward and at the peak of the backward (sampled every 10 ms;
the gradients, 0.51 GiB, are part of the peak). Configurations: ``plain`` (before
issue 15), ``recompute`` (activation checkpointing, the last block kept for the sketcher)
and ``recompute+mmap`` (plus the fixed 1 MB mmap threshold), i.e. what ``icsd train``
does now.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

MODES = ("plain", "recompute", "recompute+mmap")


def child(mode: str, rows: int, prompt: int, response: int) -> None:
    import contextlib
    import threading
    import time

    import torch

    from icsd_audit.train.update.logprobs import pack, response_logprobs
    from icsd_audit.train.models.loading import load_policy
    from icsd_audit.train.models.memory import checkpointed_blocks, decoder_blocks, map_large_allocations, release_freed_memory

    torch.set_num_threads(1)
    if mode.endswith("+mmap"):
        map_large_allocations()

    def rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    peak = [0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss())
            time.sleep(0.01)

    model, _ = load_policy("embedded", device=torch.device("cpu"))
    model.eval()
    for p in model.parameters():
        p.data.mul_(1.0)  # touch every page, as the optimizer will
    release_freed_memory()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (prompt - 37 * i,), generator=g).tolist() for i in range(rows)]
    responses = [torch.randint(100, 40000, (response - 3 * i,), generator=g).tolist() for i in range(rows)]
    packed = pack(prompts, responses, pad_id=0, device="cpu")
    threading.Thread(target=sample, daemon=True).start()
    time.sleep(0.05)
    base = rss()
    peak[0] = base
    last = decoder_blocks(model)[-1][0]
    ctx = checkpointed_blocks(model, skip=[last]) if mode != "plain" else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx:
        lp = response_logprobs(model, packed, temperature=0.7)
    time.sleep(0.05)
    after_fwd = rss()
    lp.sum().backward()
    wall = time.perf_counter() - t0
    time.sleep(0.05)
    gib = 1024**3
    print(f"{mode:<15} after forward +{(after_fwd - base) / gib:5.2f} GiB   backward peak +{(peak[0] - base) / gib:5.2f} GiB"
          f"   forward+backward {wall:5.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--response", type=int, default=48)
    ap.add_argument("--mode", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode is not None:
        child(args.mode, args.rows, args.prompt, args.response)
        return
    print(f"{args.rows} rows, longest prompt {args.prompt} tokens, {args.response}-token responses; "
          f"load average {os.getloadavg()[0]:.2f}")
    for mode in MODES:
        subprocess.run([sys.executable, __file__, "--mode", mode, "--rows", str(args.rows), "--prompt", str(args.prompt),
                        "--response", str(args.response)], check=True, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
