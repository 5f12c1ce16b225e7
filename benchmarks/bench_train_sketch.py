"""Overhead of ``sketch_k`` on one cpu-demo-sized actor mini-batch (SmolLM2-135M, CPU).

Usage:
  python benchmarks/bench_train_sketch.py --prompt 500 --response 48 --rows 4 --k 128 --repeats 3

Runs the real :class:`~icsd_audit.train.update.actor.Actor` update on one mini-batch of
``rows`` random-token rows (prompts of about ``prompt`` tokens, responses of about
``response``; one micro-batch, as in the cpu-demo preset), with and without a
:class:`~icsd_audit.grads.sketch.GradientSketcher` attached, interleaved so that load drift
hits both alike, after one warm-up round each. The learning rate is 0, so every
repeat sees the same weights. Printed: medians of the gradient micro-batches' time
(forward + backward, sketching included when on) and of the sketch's ``collect``.
The cpu-demo preset's mini-batches have 4 rows, prompts of 430 to 510 tokens and
about 170 response tokens (docs/training.md).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from icsd_audit.alloc.settings import AllocatorSettings
from icsd_audit.grads.sketch import GradientSketcher
from icsd_audit.train.update.actor import Actor, Distillation, StepData
from icsd_audit.train.models.loading import load_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=500, help="prompt tokens of the longest row")
    ap.add_argument("--response", type=int, default=48, help="response tokens of the longest row")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--k", type=int, default=128, help="sketch_k")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="1: a second thread is often slower on 2 shared cores")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cpu = torch.device("cpu")
    model, tok = load_policy("embedded", device=cpu)
    model.eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    data = StepData(
        prompts=[torch.randint(0, vocab, (a.prompt - 7 * i,), generator=g).tolist() for i in range(a.rows)],
        responses=[torch.randint(0, vocab, (a.response - 3 * i,), generator=g).tolist() for i in range(a.rows)],
        old_logp=[], advantage=torch.randn(a.rows, generator=g), traj=torch.arange(a.rows),
        turn=torch.zeros(a.rows, dtype=torch.long))
    data.old_logp = [torch.full((len(r),), -5.0) for r in data.responses]
    data.teacher_logp = [lp + 0.2 for lp in data.old_logp]
    dist = Distillation(AllocatorSettings(allocator="icsd", min_group=2), coef=0.01)
    kw = dict(distill=dist, clip_ratio=0.2, dual_clip=3.0, kl_coef=0.0, temperature=0.7, mini_batch_rows=a.rows,
              micro_batch_rows=a.rows, ppo_epochs=1, grad_clip=1.0, skip_first_prepass=True, shuffle_rows=False,
              seed=0, pad_id=tok.pad_token_id, device=cpu)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sketcher = GradientSketcher(model, k_out=a.k, k_in=a.k, seed=0, temperature=0.7)
    actors = {"off": Actor(model, opt, **kw), "on": Actor(model, opt, sketcher=sketcher, **kw)}
    times: dict[str, list[float]] = {"off": [], "on": [], "collect": []}
    for rep in range(a.repeats + 1):
        for name in (("off", "on") if rep % 2 == 0 else ("on", "off")):
            _, t, _ = actors[name].update(0, data, sink=lambda n, c: None)
            if rep:  # round 0 warms up
                times[name].append(t["grad"])
                if name == "on":
                    times["collect"].append(t["sketch"])
    n_tok = sum(len(r) for r in data.responses)
    off, on, col = (statistics.median(times[k]) for k in ("off", "on", "collect"))
    print(f"{a.rows} rows, prompts <= {a.prompt} + responses <= {a.response} tokens ({n_tok} response tokens), "
          f"k = {a.k}, {a.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    print(f"gradient micro-batches: off {off:.3f} s, on {on:.3f} s ({100 * (on / off - 1):+.1f} %); "
          f"collect {col:.3f} s ({100 * col / off:.1f} % of off)")
    print("all:", {k: [round(x, 3) for x in v] for k, v in times.items()})


if __name__ == "__main__":
    main()
