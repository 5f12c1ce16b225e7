"""The built-in loop against the TRL engine on the same work: per-phase step times, their ratio, peak RSS.

Usage:
    python benchmarks/bench_engines.py                         # embedded SmolLM2-135M, full and LoRA r=8
    python benchmarks/bench_engines.py --lora 0 8 --repeats 2 --bf16
    python benchmarks/bench_engines.py --model tiny-random     # seconds: checks the script itself

TRL comes from the engines environment (docs/engines.md):
    python -m venv --system-site-packages .ci-engines
    .ci-engines/bin/pip install -c <(echo torch==2.13.0) -e '.[train,verl,trl]'
    .ci-engines/bin/python benchmarks/bench_engines.py
(``--engines builtin`` runs without TRL.)

**The same work on both.** Preset ``cpu-demo`` (its prompts, temperature, lr, KL, lambda, ICSD,
activation checkpointing) without its warm start (the plain model, fully fine-tuned or with a
fresh adapter of each ``--lora`` rank) and with ``max_turns = 1``: one reply per episode, so the built-in turn
row and TRL's episode row are the same first prompt and one reply of at most
``--response`` tokens; ``--tasks`` x ``--group`` episodes; GRPO (TRL's advantage); one
optimizer step per training step on both (built-in ``mini_batch_rows`` and
``micro_batch_rows`` = the step's rows, TRL's ``per_device_train_batch_size``); no gradient
sketches; one training step. What still differs is each engine's own design: TRL scores
the student once more without gradient (it needs ``delta`` and does not keep the
sampler's log-probs) and, without LoRA, keeps a second, resident copy of the weights as
its reference; the built-in loop reads its reference from disk for each pass. The
sampled replies differ (each engine seeds its own sampler), so the token counts of each
run are printed next to its times.

Each run is a fresh child process (its peak RSS is that process's ``ru_maxrss``, model
load included), and runs are interleaved: for each repeat, every LoRA setting x engine
in turn, so that the load of a shared machine falls on both engines alike. The load
average is printed before and after each run. Figures are medians over repeats.

Phases (seconds): ``rollout`` (sampling + environment), ``old_logp`` (a no-grad student
pass: TRL's, or the built-in's with ``recompute_old_logp``), ``teacher`` (privileged
prompt, no grad), ``reference`` (KL target: TRL's reference pass and reward bookkeeping;
built-in: the reference pass), ``actor`` (forward + backward + optimizer step; built-in:
pre-pass and allocation included, dump writing excluded), ``other`` (the rest of the
step: allocation and dumps on TRL, advantages and dumps on the built-in loop), ``step``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("rollout", "old_logp", "teacher", "reference", "actor", "other", "step")


def run_config(args: argparse.Namespace, lora: int, precision: str, out: Path) -> Any:
    from icsd_audit.train.config import TrainConfig, from_preset, parse_override

    rows = args.tasks * args.group
    cfg = from_preset(
        "cpu-demo", model=args.model, out_dir=str(out), total_steps=1, max_turns=1, n_tasks=args.tasks,
        group_size=args.group, max_response_tokens=args.response, adv_estimator="grpo", mini_batch_rows=rows,
        micro_batch_rows=rows, rollout_batch_rows=rows, sketch_k=0, lora_rank=lora, precision=precision,
        threads=args.threads, lr=args.lr, init=None)  # the plain model: the preset's rank-4 warm start would fix the rank
    return cfg.replace(**dict(parse_override(item) for item in args.set))


# ------------------------------------------------------------------------------------------ workers


def work_builtin(cfg: Any) -> dict[str, Any]:
    from icsd_audit.train.loop import train

    rec = train(cfg).records[0]
    t = {"rollout": rec["time/rollout"], "old_logp": rec["time/old_logp"], "teacher": rec["time/teacher"],
         "reference": rec["time/reference"], "actor": rec["time/actor"], "step": rec["time/step"]}
    t["other"] = t["step"] - sum(t[k] for k in PHASES[:5])
    n = rec["rollout/rows"]
    return {"times": t, "rows": n, "response_tokens": rec["rollout/response_tokens_mean"] * n,
            "prompt_tokens": rec["rollout/prompt_tokens_mean"] * n}


def work_trl(cfg: Any) -> dict[str, Any]:
    import transformers
    from trl import GRPOTrainer

    from icsd_audit.integrations.trl import engine as engines
    from icsd_audit.integrations.trl.trainer import ICSDGRPOTrainer
    from icsd_audit.integrations.trl.rollout import EpisodeRollout

    acc: dict[str, list[float]] = {k: [] for k in ("rollout", "trl_base", "icsd", "score", "prepare", "step")}
    tokens = {"rows": 0, "response_tokens": 0, "prompt_tokens": 0}

    def timed(cls: type, name: str, key: str, after: Any = None) -> None:
        inner = getattr(cls, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(*a, **k)
            acc[key].append(time.perf_counter() - t0)
            if after is not None:
                after(out)
            return out

        setattr(cls, name, wrapper)

    def count(batch: dict[str, list]) -> None:
        tokens["rows"] += len(batch["prompt_ids"])
        tokens["response_tokens"] += sum(sum(m) for m in batch["env_mask"])
        tokens["prompt_tokens"] += sum(len(p) for p in batch["prompt_ids"])

    timed(EpisodeRollout, "__call__", "rollout", count)
    timed(GRPOTrainer, "_generate_and_score_completions", "trl_base")
    timed(ICSDGRPOTrainer, "_generate_and_score_completions", "icsd")
    timed(ICSDGRPOTrainer, "_score", "score")
    timed(GRPOTrainer, "_prepare_inputs", "prepare")

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            acc["step"].append(time.perf_counter() - self.t0)

    init = GRPOTrainer.__init__

    def init_with_timer(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        self.add_callback(StepTimer())

    GRPOTrainer.__init__ = init_with_timer  # type: ignore[method-assign]
    engines.run_trl(cfg)
    score = acc["score"]
    t = {"rollout": sum(acc["rollout"]), "teacher": score[0] if score else 0.0,
         "old_logp": sum(score[1:]), "step": sum(acc["step"])}
    t["reference"] = sum(acc["trl_base"]) - t["rollout"]
    t["actor"] = t["step"] - sum(acc["prepare"])
    t["other"] = t["step"] - sum(t[k] for k in PHASES[:5])
    return {"times": t, **tokens}


def worker(engine: str, cfg_json: str, result: Path) -> None:
    from icsd_audit.train.config import TrainConfig

    os.environ.setdefault("TQDM_DISABLE", "1")
    cfg = TrainConfig.from_dict(json.loads(cfg_json))
    res = work_builtin(cfg) if engine == "builtin" else work_trl(cfg)
    res["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    result.write_text(json.dumps(res))


# ------------------------------------------------------------------------------------------ driver


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--tasks", type=int, default=2, help="tasks per step")
    ap.add_argument("--group", type=int, default=4, help="episodes per task")
    ap.add_argument("--response", type=int, default=48, help="max reply tokens")
    ap.add_argument("--lora", type=int, nargs="+", default=[0, 8], help="LoRA ranks to run (0: full fine-tuning)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--engines", nargs="+", default=["builtin", "trl"], choices=["builtin", "trl"])
    ap.add_argument("--bf16", action="store_true", help="also the built-in loop with precision=bf16-mixed")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each run (both engines)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config field for every run, both engines (e.g. recompute_activations=false)")
    ap.add_argument("--worker", nargs=3, metavar=("ENGINE", "CFG", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], Path(args.worker[2]))
        return

    runs = [(e, r, "float32") for r in args.lora for e in args.engines]
    if args.bf16:
        runs += [("builtin", r, "bf16-mixed") for r in args.lora]
    print(f"model {args.model}; {args.tasks} tasks x {args.group} episodes, 1 turn, replies <= {args.response} "
          f"tokens; {args.threads} thread(s); {args.repeats} repeat(s); {os.cpu_count()} CPUs; load {_load()}",
          flush=True)
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = {k: [] for k in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for engine, lora, prec in runs:
                out = Path(tmp) / f"{engine}-{lora}-{prec}-{rep}"
                cfg = run_config(args, lora, prec, out).validate()
                res_file = Path(tmp) / f"{out.name}.json"
                load0, t0 = _load(), time.perf_counter()
                proc = subprocess.run([sys.executable, __file__, "--worker", engine, json.dumps(cfg.to_dict()),
                                       str(res_file)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if proc.returncode != 0:
                    sys.exit(f"{engine} run failed:\n{proc.stderr[-3000:]}")
                res = json.loads(res_file.read_text())
                res["wall"] = time.perf_counter() - t0
                results[(engine, lora, prec)].append(res)
                t = res["times"]
                print(f"  run {rep} {engine:7s} lora {lora:2d} {prec:10s}: step {t['step']:7.1f} s (rollout "
                      f"{t['rollout']:.1f}, actor {t['actor']:.1f}), {res['rows']} rows, "
                      f"{res['response_tokens']:.0f} reply / {res['prompt_tokens']:.0f} prompt tokens, peak RSS "
                      f"{res['peak_rss_gb']:.2f} GB, process {res['wall']:.0f} s; load {load0} -> {_load()}",
                      flush=True)
    med = {k: {p: statistics.median(r["times"][p] for r in v) for p in PHASES} for k, v in results.items()}
    rss = {k: statistics.median(r["peak_rss_gb"] for r in v) for k, v in results.items()}
    for lora in args.lora:
        for prec in ("float32", "bf16-mixed") if args.bf16 else ("float32",):
            have = [e for e in args.engines if (e, lora, prec) in med]
            if not have:
                continue
            print(f"\n{'LoRA r=' + str(lora) if lora else 'full fine-tuning'}, {prec} (median seconds)")
            print(f"  {'phase':10s}" + "".join(f"{e:>10s}" for e in have) + ("  builtin/trl" if len(have) == 2 else ""))
            for p in PHASES:
                vals = [med[(e, lora, prec)][p] for e in have]
                ratio = f"  {vals[0] / vals[1]:11.2f}" if len(have) == 2 and vals[1] > 0 else ""
                print(f"  {p:10s}" + "".join(f"{v:10.1f}" for v in vals) + ratio)
            print(f"  {'peak RSS':10s}" + "".join(f"{rss[(e, lora, prec)]:8.2f}GB" for e in have))
    print()
    for e in args.engines:
        full = med.get((e, 0, "float32"))
        for lora in (r for r in args.lora if r):
            lo = med.get((e, lora, "float32"))
            if full and lo:
                print(f"{e}: LoRA r={lora} vs full: actor {full['actor'] / lo['actor']:.2f}x faster, step "
                      f"{full['step'] / lo['step']:.2f}x")
    if args.bf16:
        for lora in args.lora:
            a, b = med.get(("builtin", lora, "float32")), med.get(("builtin", lora, "bf16-mixed"))
            if a and b:
                print(f"builtin lora {lora}: bf16-mixed / float32 step {b['step'] / a['step']:.2f}, actor "
                      f"{b['actor'] / a['actor']:.2f}")
    print(f"load average at the end {_load()}")


if __name__ == "__main__":
    main()
