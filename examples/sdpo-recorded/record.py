"""examples/sdpo-recorded: record a TRL SDPO run with ``record(trainer, dump_dir)`` and audit it.

Usage: python examples/sdpo-recorded/record.py OUT_DIR [--steps 16]

Saves the tiny random model (``tiny_random_causal_lm(seed=0)``) to ``OUT_DIR/model`` (SDPO builds its
teacher from the model's path, so the model is loaded from a folder), trains TRL 1.16's ``SDPOTrainer``
with its default distillation (``sampled_token``, weight 1, EMA teacher) on CPU, one torch thread, seed 0, with ``record`` writing ``OUT_DIR/dumps``, then runs
``icsd audit verify`` and ``icsd audit report`` on them (``OUT_DIR/report``; the self-contained
``report.html`` is written too). Prints the wall time of the training and of the report and the load
average before and after.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

PROMPTS = ["find a red mug", "buy blue shoes", "open the drawer", "find a wooden chair"]


def reward(completions: list[str], **_: object) -> list[float]:
    """1 when the completion holds the letter e (either case), else 0: a success a random model sometimes hits."""
    return [float("e" in c.lower()) for c in completions]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()

    import datasets
    import torch
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    from icsd_audit.integrations.trl import record
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    torch.set_num_threads(1)
    out: Path = args.out
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} is not empty", file=sys.stderr)
        return 2
    model, tok = tiny_random_causal_lm(seed=0)
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    cfg = SDPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=16, num_generations=4,
                     max_completion_length=64, max_steps=args.steps, learning_rate=1e-3, temperature=1.0,
                     use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                     logging_steps=1, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = SDPOTrainer(model=str(out / "model"), processing_class=tok, reward_funcs=reward,
                          train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS * (4 * args.steps)}), args=cfg)
    record(trainer, out / "dumps", producer={"model": "tiny-random seed 0", "example": "examples/sdpo-recorded"})
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    load1 = os.getloadavg()
    subprocess.run(["icsd", "audit", "verify", "dumps"], check=True, cwd=out)
    t0 = time.perf_counter()  # relative paths, so the report's provenance names dumps/ wherever OUT_DIR is
    subprocess.run(["icsd", "audit", "report", "dumps", "--out", "report"], check=True, cwd=out)
    report_s = time.perf_counter() - t0
    print(f"training: {args.steps} steps in {train_s:.1f} s wall; report {report_s:.1f} s wall; "
          f"load average (1 min) {load0[0]:.1f} before, {load1[0]:.1f} after training, {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
