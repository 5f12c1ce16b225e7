"""Checkpoints: the policy as a loadable Hugging Face folder plus optimizer and RNG state.

``<out_dir>/checkpoints/step-000009/`` holds ``save_pretrained`` output (weights as
safetensors, config, tokenizer with its chat template: ``icsd eval --model`` and any
HF code load it as is) and ``trainer_state.pt`` (the next step to run, the optimizer
state, the Python/NumPy/torch/CUDA RNG states, the config). A checkpoint is written
into a temporary folder and renamed into place, so a crash never leaves a partial one
where :func:`latest_checkpoint` would find it. Only the newest ``keep`` are kept
(``--keep-checkpoints``, default 1). Sizes for the 135M default: 0.54 GB of weights
plus 1.08 GB of AdamW moments; ``checkpoint_optimizer=False`` writes the weights and
RNG state only.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["save_checkpoint", "load_trainer_state", "latest_checkpoint", "checkpoint_dir", "rng_state", "set_rng_state"]

_PREFIX = "step-"
STATE_FILE = "trainer_state.pt"


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: str | Path, *, next_step: int, model: Any, tokenizer: Any, optimizer: Any,
                    config: dict[str, Any], keep: int = 1, extra: dict[str, Any] | None = None,
                    with_optimizer: bool = True) -> Path:
    """Write the checkpoint taken after ``next_step - 1`` steps; prune all but the newest ``keep``.

    ``with_optimizer=False`` leaves AdamW's moments out (two thirds of a checkpoint's
    size); ``trainer_state.pt`` then holds ``"optimizer": None``.
    """
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{_PREFIX}{next_step - 1:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        opt_state = optimizer.state_dict() if with_optimizer else None
        torch.save({"next_step": int(next_step), "optimizer": opt_state, "rng": rng_state(),
                    "config": config, **(extra or {})}, tmp / STATE_FILE)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ckpts = sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and (p / STATE_FILE).is_file())
    for old in ckpts[: max(0, len(ckpts) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``out_dir`` (None when there is none)."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return None
    ckpts = sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and (p / STATE_FILE).is_file())
    return ckpts[-1] if ckpts else None


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    f = p / STATE_FILE if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{p} is not an icsd checkpoint (no {STATE_FILE}); pass a folder under <out_dir>/checkpoints/")
    return torch.load(f, map_location="cpu", weights_only=False)
