"""Run folders written by hand for the compare tests (config.json + metrics.jsonl, as the built-in loop writes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

BASE_CONFIG = {"adv_estimator": "grpo", "allocator": "icsd", "env": "webshop", "lr": 1e-5, "model": "embedded",
               "seed": 0, "total_steps": 10, "out_dir": "x"}


def write_run(folder: Path, records: Sequence[Mapping[str, Any]], **config: Any) -> Path:
    """A run folder: ``config.json`` (BASE_CONFIG updated by ``config``) and one JSONL record per item."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**BASE_CONFIG, **config, "out_dir": str(folder)}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def series_run(folder: Path, key: str, values: Sequence[float | None], **config: Any) -> Path:
    """A run logging ``key`` with ``values`` at steps 0, 1, ..."""
    return write_run(folder, [{"step": i, key: v} for i, v in enumerate(values)], **config)
