"""Cost of ``record(trainer, dump_dir)`` per optimizer step on the tiny model (CPU).

Usage: python benchmarks/bench_record.py [--steps 8] [--repeats 3] [--threads 1] [--length 32]
                                         [--kinds grpo sdpo sdft]

For each trainer (GRPO; SDPO top-k 100 at weight 0.5; SDFT), trains ``steps`` optimizer steps of 8
completions of up to ``length`` tokens from the tiny random model saved to a folder, with and without
``record``, ``repeats`` times interleaved (the order alternating), and prints

* the median step time of each (steps after the first; a callback times each optimizer step);
* the recorder's own time per step: everything ``record`` adds inside a step (the log-probs and
  entropies it derives from the trainer's logits, the top-k membership, checks, the rows, the
  shard written at the step's end), timed by wrapping its functions, so the figure does not drown in the noise of a
  shared machine; its median over the steps after the first, as a share of the plain step
  (target: < 3 %), and its time in the first step apart (one-time costs: the step folder's
  first write, the metadata's encoding).

Times are the CPU time of the whole process (``time.process_time``: every thread, Arrow's and any
writer thread included; torch runs on one thread with ``--threads 1``), so other processes on a
shared machine do not inflate them while nothing the recorder does on another thread of this
process escapes them.  The recorder's own share is the figure to compare with the target.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402


def _timer(total: list[float], fn):
    """``fn`` timed into ``total[0]``; nested timed calls (``total[1]`` deep) are counted once, outermost."""
    def timed(*a, **k):
        total[1] += 1
        t0 = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            total[1] -= 1
            if total[1] == 0:
                total[0] += time.process_time() - t0

    return timed


def _trainer(kind: str, model_dir: Path, out: Path, steps: int, length: int):
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = ["search for a red mug", "buy blue shoes under 30 dollars", "find a wooden chair", "open the drawer"]
    common = dict(output_dir=str(out), per_device_train_batch_size=8, max_completion_length=length, max_steps=steps,
                  learning_rate=1e-3, use_cpu=True, bf16=False, report_to=[], save_strategy="no", seed=0,
                  dataloader_num_workers=0, disable_tqdm=True, logging_steps=10**6)
    ds = datasets.Dataset.from_dict({"prompt": prompts * 16})

    def reward(completions, **_):
        return [float(len(c) % 3) for c in completions]

    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        return GRPOTrainer(model=str(model_dir), processing_class=tok, reward_funcs=reward,
                           args=GRPOConfig(num_generations=4, **common), train_dataset=ds)
    if kind == "sdpo":
        from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

        return SDPOTrainer(model=str(model_dir), processing_class=tok, reward_funcs=reward, train_dataset=ds,
                           args=SDPOConfig(num_generations=4, distillation_mode="topk_logits", distillation_topk=100,
                                           distillation_alpha=0.5, distillation_weight=0.5, **common))
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    ds = ds.add_column("privileged_context", ["the answer is yes"] * len(ds))
    return SDFTTrainer(model=str(model_dir), processing_class=tok, args=SDFTConfig(**common), train_dataset=ds)


def _run(kind: str, model_dir: Path, root: Path, *, steps: int, length: int, recorded: bool) -> tuple[float, float]:
    """(median step seconds after the first, recorder seconds per step) of one training run."""
    from transformers import TrainerCallback

    import icsd_audit.integrations.trl.recorder as R

    times: list[float] = []
    owns: list[float] = []
    own = [0.0, 0]

    class StepTimer(TrainerCallback):  # CPU time of the whole process, every thread
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.own0 = time.process_time(), own[0]

        def on_step_end(self, args, state, control, **kw):
            times.append(time.process_time() - self.t0)
            owns.append(own[0] - self.own0)

    tr = _trainer(kind, model_dir, root / "out", steps, length)
    saved = {}
    if recorded:
        for name in ("sampled_token_logps", "student_logps_and_entropy", "student_entropy", "teacher_token_logps"):
            if not hasattr(R, name):  # (an older recorder, measured for comparison)
                continue
            saved[name] = getattr(R, name)
            setattr(R, name, _timer(own, saved[name]))
        for name in ("add", "flush"):
            saved["Recorder." + name] = getattr(R.Recorder, name)
            setattr(R.Recorder, name, _timer(own, saved["Recorder." + name]))
        R.record(tr, root / f"dumps-{time.monotonic_ns()}")
    tr.add_callback(StepTimer())  # after record's own callback: the step's time includes its shard
    try:
        tr.train()
    finally:
        for name, fn in saved.items():
            if name.startswith("Recorder."):
                setattr(R.Recorder, name.split(".")[1], fn)
            else:
                setattr(R, name, fn)
    return statistics.median(times[1:]), statistics.median(owns[1:]), owns[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--kinds", nargs="+", default=["grpo", "sdpo", "sdft"], choices=["grpo", "sdpo", "sdft"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    print(f"load: {os.getloadavg()[0]:.2f} (1-min) on {os.cpu_count()} CPUs; torch threads {args.threads}; "
          f"{args.steps} steps x 8 completions of <= {args.length} tokens, {args.repeats} repeats; "
          "process CPU time per optimizer step, medians")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, tok = tiny_random_causal_lm(seed=0)
        model.save_pretrained(root / "model")
        tok.save_pretrained(root / "model")
        print(f"{'trainer':8} {'plain step':>11} {'recorded':>11} {'end-to-end':>11} {'recorder/step':>14} {'share':>7} "
              f"{'first step':>11}")
        for kind in args.kinds:
            plain, rec, own, first = [], [], [], []
            for r in range(args.repeats):
                # the order alternates (a later run in one process can be slower: a larger heap for the
                # collector to walk), and each run starts from a collected heap
                for recorded in ((False, True) if r % 2 == 0 else (True, False)):
                    gc.collect()
                    s, o, f = _run(kind, root / "model", root / f"{kind}-{'r' if recorded else 'p'}{r}",
                                   steps=args.steps, length=args.length, recorded=recorded)
                    if recorded:
                        rec.append(s)
                        own.append(o)
                        first.append(f)
                    else:
                        plain.append(s)
            p, q, o = statistics.median(plain), statistics.median(rec), statistics.median(own)
            print(f"{kind:8} {1e3 * p:9.1f}ms {1e3 * q:9.1f}ms {100 * (q - p) / p:+10.1f}% {1e3 * o:12.2f}ms "
                  f"{100 * o / p:6.2f}% {1e3 * statistics.median(first):9.2f}ms")
        print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
