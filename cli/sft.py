"""``icsd sft``: a warm start from the environment's expert (supervised fine-tuning, LoRA or full)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from .apps import app
from .common import handle_errors
from .train import _build_config, _require_train_extra


@app.command("sft")
@handle_errors
def sft_cmd(
    out: Path = typer.Option(..., "--out", "-o", help="New folder for the warm start (adapter or model, sft.json)."),
    env: Optional[str] = typer.Option(None, help="Environment: webshop (default), alfworld or searchqa."),
    preset: str = typer.Option(
        "cpu-demo", help="The training preset the warm start is for: its prompts, turn budget, reply length and "
                         "temperatures are the ones trained on and evaluated with (paper or cpu-demo, per env)."),
    model: Optional[str] = typer.Option(None, help="Base model: 'embedded' (default), 'tiny-random' or a local folder."),
    episodes: int = typer.Option(64, help="Expert episodes on distinct train-split tasks to imitate."),
    heldout_episodes: int = typer.Option(
        16, help="Expert episodes on the first held-out tasks: the held-out loss (never trained on)."),
    tasks: int = typer.Option(16, "--tasks", help="Held-out tasks the trained policy plays for its success rate (0: skip)."),
    epochs: int = typer.Option(2, help="Passes over the training turns."),
    lr: float = typer.Option(2e-4, help="Peak learning rate (linear warm-up, cosine decay)."),
    batch_rows: int = typer.Option(8, help="Turns per optimizer step."),
    micro_batch_rows: int = typer.Option(2, help="Turns per forward/backward micro-batch."),
    lora: int = typer.Option(8, "--lora", help="LoRA rank (0: full fine-tuning of every weight)."),
    lora_alpha: Optional[float] = typer.Option(None, help="LoRA alpha (default 2 * rank)."),
    lora_targets: str = typer.Option("all-linear", help="Modules with adapters: all-linear or e.g. q_proj,v_proj."),
    recompute: bool = typer.Option(True, "--recompute/--no-recompute",
                                   help="Activation checkpointing: less memory, one more forward per micro-batch."),
    seed: int = typer.Option(0, help="Seeds the task draw, the adapter's initial weights, the turn order, evaluation."),
    set_: List[str] = typer.Option([], "--set", help="Any training config field the prompts depend on: --set "
                                                     "history_window=2 (repeatable; icsd train --list-fields)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="--out exists: move it aside (OUT.old-DATE) first."),
) -> None:
    """Warm-start a policy from the environment's expert: fine-tune on its turns, rendered as the trainer's prompts.

    The expert plays --episodes train tasks through the training loop's own rollout (the preset's prompt builder: student prompts, no privileged context); the policy is fine-tuned on its replies (LoRA by default) and measured on held-out tasks: the loss on the expert's held-out turns, and the success of its own episodes (icsd eval's code). The folder is what icsd train --init takes.

    Example: icsd sft --env webshop --episodes 64 --out runs/sft-webshop && icsd train --preset cpu-demo --init runs/sft-webshop --out runs/warm
    """
    _require_train_extra("sft")
    if not sys.stderr.isatty():
        import os

        os.environ.setdefault("TQDM_DISABLE", "1")  # third-party bars would flood a piped log
    from icsd_audit.train.sft import SFTConfig, run_sft

    cfg = _build_config(preset, dict(env=env, model=model, seed=seed), set_)
    sft = SFTConfig(episodes=episodes, heldout_episodes=heldout_episodes, eval_tasks=tasks, epochs=epochs, lr=lr,
                    batch_rows=batch_rows, micro_batch_rows=micro_batch_rows, lora_rank=lora, lora_alpha=lora_alpha,
                    lora_targets=lora_targets, seed=seed,
                    recompute_activations=recompute).validate()

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    res = run_sft(cfg, sft, out, say=say, overwrite=overwrite)
    ev = res.report.get("eval") or {}
    last = res.report["epochs"][-1]
    summary = f"warm start written to {res.out_dir}: held-out loss {res.report['epochs'][0]['heldout_loss']} -> " \
              f"{last['heldout_loss']}"
    if ev:
        summary += f"; held-out success {ev['success']:.3f}, score {ev['score']:.3f}, invalid {ev['invalid_rate']:.3f}"
    print(summary)
