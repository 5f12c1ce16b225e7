"""Actor-update cost of ICSD over SDAR per mini-batch, with the allocation fitted per mini-batch
(no-grad ratio pre-pass) or per micro-batch (from the gradient forward, no extra pass).

Usage:
  python benchmarks/bench_alloc_scope.py --model embedded --rows 8 --micro 4 --prompt 256 --response 32 \
      --mini-batches 3 --repeats 2
  python benchmarks/bench_alloc_scope.py --alloc-only --rows 512 --micro 8 --response 150 --repeats 5

``--alloc-only`` times just the allocation step as the actor runs it (canonical sort,
float64 allocation, scatter back) for one mini-batch of the paper's size (Table A1
WebShop: 64 prompts x 8 rollouts = 512 turn rows; 8-row micro-batches), SDAR vs ICSD,
over the whole mini-batch (one call) or micro-batch by micro-batch (one call each).

Runs the real :class:`~icsd_audit.train.update.actor.Actor` update (PPO dual clip + k3 KL +
allocated distillation, SGD with lr 0 so every repeat sees the same weights) on
``mini-batches`` actor mini-batches of ``rows`` random-token rows each (prompts of
about ``prompt`` tokens, responses of about ``response``; ``micro`` rows per gradient
micro-batch), for the four combinations {sdar, icsd} x {mini-batch, micro-batch}.
The combinations are interleaved in a rotating order, after one warm-up round, so that
load drift on a shared machine hits them alike. Per mini-batch it prints the medians
over repeats of: the allocation time, the pre-pass time and the whole actor update
(pre-pass + allocation + gradient micro-batches + optimizer step; dump writing is
off). The step's first mini-batch skips the pre-pass (``skip_first_prepass``), so the
per-mini-batch pre-pass is the mean over all mini-batches, as in training.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from icsd_audit.alloc.settings import AllocatorSettings
from icsd_audit.train.update.actor import Actor, Distillation, StepData
from icsd_audit.train.models.loading import load_policy

COMBOS = [("sdar", "mini-batch"), ("icsd", "mini-batch"), ("sdar", "micro-batch"), ("icsd", "micro-batch")]


def make_data(vocab: int, *, n_rows: int, prompt: int, response: int, seed: int) -> StepData:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (max(8, prompt - int(torch.randint(0, prompt // 4 + 1, (1,), generator=g))),),
                             generator=g).tolist() for _ in range(n_rows)]
    responses = [torch.randint(0, vocab, (max(4, response - int(torch.randint(0, response // 2 + 1, (1,),
                                                                               generator=g))),), generator=g).tolist()
                 for _ in range(n_rows)]
    # two turns per trajectory, the advantage constant over a trajectory
    traj = torch.arange(n_rows) // 2
    adv = torch.randn(n_rows // 2 + 1, generator=g)[traj]
    old = [torch.full((len(r),), -3.0) - torch.rand(len(r), generator=g) for r in responses]
    data = StepData(prompts=prompts, responses=responses, old_logp=old, advantage=adv, traj=traj,
                    turn=torch.arange(n_rows) % 2)
    data.teacher_logp = [lp + 0.3 * torch.randn(lp.shape, generator=g) for lp in old]
    data.ref_logp = [lp - 0.05 for lp in old]
    return data


def alloc_only(a: argparse.Namespace) -> None:
    """Allocation time per mini-batch, whole mini-batch vs per micro-batch, SDAR vs ICSD."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(max(1, a.response // 2), a.response + 1, (a.rows,), generator=g)
    n = int(lens.sum())
    row = torch.repeat_interleave(torch.arange(a.rows), lens)
    traj, turn = row // 2, row % 2  # two turns per trajectory
    adv = torch.randn(a.rows // 2 + 1, generator=g)[row // 2]
    ratio = torch.exp(0.02 * torch.randn(n, generator=g))
    delta = 0.5 * torch.randn(n, generator=g)
    pos = torch.arange(n) - (torch.cumsum(lens, 0) - lens)[row]
    bounds = torch.cumsum(lens, 0).tolist()
    micro_edges = [0] + [bounds[min(i + a.micro, a.rows) - 1] for i in range(0, a.rows, a.micro)]
    res: dict[tuple[str, str], list[float]] = {}
    for rep in range(a.repeats + 1):
        for allocator in ("sdar", "icsd"):
            act = Actor.__new__(Actor)  # only the allocation step is used
            act.distill = Distillation(AllocatorSettings(allocator=allocator, min_group=8), coef=0.01)
            for scope in ("mini-batch", "micro-batch"):
                t0 = time.perf_counter()
                spans = [(0, n)] if scope == "mini-batch" else list(zip(micro_edges[:-1], micro_edges[1:]))
                for j, (lo, hi) in enumerate(spans):
                    act._allocate_canonical(adv=adv[lo:hi], ratio=ratio[lo:hi], delta=delta[lo:hi], traj=traj[lo:hi],
                                            turn=turn[lo:hi], pos=pos[lo:hi], bid=j, score_norm=None)
                if rep:
                    res.setdefault((allocator, scope), []).append(time.perf_counter() - t0)
    print(f"allocation only: {a.rows} rows, {n} tokens per mini-batch, micro-batches of {a.micro} rows, "
          f"{a.threads} thread(s), {a.repeats} repeats, load average {os.getloadavg()[0]:.2f}")
    for scope in ("mini-batch", "micro-batch"):
        s_, i_ = (statistics.median(res[(x, scope)]) for x in ("sdar", "icsd"))
        print(f"{scope:12s}: sdar {1e3 * s_:.1f} ms, icsd {1e3 * i_:.1f} ms per mini-batch "
              f"(icsd - sdar {1e3 * (i_ - s_):+.1f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alloc-only", action="store_true", help="time only the allocation step (no model)")
    ap.add_argument("--model", default="embedded", help="'embedded' (SmolLM2-135M) or 'tiny-random'")
    ap.add_argument("--rows", type=int, default=8, help="rows (action turns) per actor mini-batch")
    ap.add_argument("--micro", type=int, default=4, help="rows per gradient micro-batch")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--mini-batches", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.alloc_only:
        alloc_only(a)
        return
    cpu = torch.device("cpu")
    model, tok = load_policy(a.model, device=cpu)
    model.eval()
    data = make_data(model.config.vocab_size, n_rows=a.rows * a.mini_batches, prompt=a.prompt, response=a.response,
                     seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def actor(allocator: str, scope: str) -> Actor:
        dist = Distillation(AllocatorSettings(allocator=allocator, min_group=8), coef=0.01)
        return Actor(model, opt, distill=dist, clip_ratio=0.2, dual_clip=3.0, kl_coef=0.01, temperature=1.0,
                     mini_batch_rows=a.rows, micro_batch_rows=a.micro, ppo_epochs=1, grad_clip=1.0,
                     skip_first_prepass=True, shuffle_rows=False, seed=0, pad_id=tok.pad_token_id, device=cpu,
                     alloc_scope=scope)

    actors = {c: actor(*c) for c in COMBOS}
    res: dict[tuple[str, str], dict[str, list[float]]] = {c: {"alloc": [], "prepass": [], "update": []} for c in COMBOS}
    for rep in range(a.repeats + 1):
        order = COMBOS[rep % 4:] + COMBOS[:rep % 4]
        for c in order:
            t0 = time.perf_counter()
            _, t, _ = actors[c].update(0, data)
            wall = time.perf_counter() - t0
            if rep:  # round 0 warms up
                n = a.mini_batches
                res[c]["alloc"].append(t.get("allocation", 0.0) / n)
                res[c]["prepass"].append(t.get("prepass", 0.0) / n)
                res[c]["update"].append(wall / n)
    n_tok = sum(len(r) for r in data.responses) / a.mini_batches
    print(f"model {a.model}: {a.mini_batches} mini-batches of {a.rows} rows ({n_tok:.0f} response tokens each), "
          f"micro-batches of {a.micro} rows, prompts <= {a.prompt}, responses <= {a.response} tokens, "
          f"{a.threads} thread(s), {a.repeats} repeats, load average {os.getloadavg()[0]:.2f}")
    med = {c: {k: statistics.median(v) for k, v in r.items()} for c, r in res.items()}
    print(f"{'allocator':10s} {'scope':12s} {'allocation ms':>14s} {'pre-pass s':>11s} {'actor update s':>15s}")
    for c in COMBOS:
        m = med[c]
        print(f"{c[0]:10s} {c[1]:12s} {1e3 * m['alloc']:14.2f} {m['prepass']:11.3f} {m['update']:15.3f}")
    for scope in ("mini-batch", "micro-batch"):
        s, i = med[("sdar", scope)], med[("icsd", scope)]
        print(f"{scope}: ICSD over SDAR: allocation {1e3 * (i['alloc'] - s['alloc']):+.2f} ms per mini-batch, "
              f"actor update {100 * (i['update'] / s['update'] - 1):+.2f} % "
              f"(allocation difference alone: {100 * (i['alloc'] - s['alloc']) / s['update']:+.3f} % of the update)")
    for alloc in ("sdar", "icsd"):
        mini, micro = med[(alloc, "mini-batch")], med[(alloc, "micro-batch")]
        print(f"{alloc}: mini-batch scope over micro-batch scope: {100 * (mini['update'] / micro['update'] - 1):+.1f} %")
    print("all:", {f"{c[0]}/{c[1]}": {k: [round(x, 4) for x in v] for k, v in r.items()} for c, r in res.items()})


if __name__ == "__main__":
    main()
