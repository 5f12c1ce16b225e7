"""Disk (issue 15): how many checkpoints are kept, and weights-only checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from icsd_audit.train.config import preset
from icsd_audit.train.loop import train

from .test_loop import bank, tiny_cfg, varied_factory  # noqa: F401  (bank is a fixture)


class Messages:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __getattr__(self, name):  # every other reporter call is a no-op
        return lambda *a, **k: None

    def message(self, text: str) -> None:
        self.lines.append(text)


def test_keep_checkpoints_default_is_one() -> None:
    from icsd_audit.train.config import TrainConfig

    assert TrainConfig().keep_checkpoints == 1 and preset("cpu-demo").keep_checkpoints == 1


def test_only_the_newest_n_are_kept(tmp_path: Path, bank: str) -> None:  # noqa: F811
    res = train(tiny_cfg(tmp_path / "r", bank, total_steps=3, checkpoint_every=1, keep_checkpoints=2),
                env_factory=varied_factory())
    names = sorted(p.name for p in (res.out_dir / "checkpoints").iterdir())
    assert names == ["step-000001", "step-000002"]


def test_weights_only_checkpoint_is_smaller_and_resumes(tmp_path: Path, bank: str) -> None:  # noqa: F811
    full = train(tiny_cfg(tmp_path / "full", bank, total_steps=1, checkpoint_every=1), env_factory=varied_factory())
    lean = train(tiny_cfg(tmp_path / "lean", bank, total_steps=1, checkpoint_every=1, checkpoint_optimizer=False),
                 env_factory=varied_factory())
    sf, sl = (torch.load(r.checkpoint / "trainer_state.pt", weights_only=False) for r in (full, lean))
    assert sf["optimizer"]["state"] and sl["optimizer"] is None and sl["next_step"] == 1
    assert (lean.checkpoint / "trainer_state.pt").stat().st_size < (full.checkpoint / "trainer_state.pt").stat().st_size
    rep = Messages()
    resumed = train(tiny_cfg(tmp_path / "lean", bank, total_steps=2, checkpoint_every=1, checkpoint_optimizer=False),
                    resume=True, reporter=rep, env_factory=varied_factory())
    assert resumed.start_step == 1 and resumed.next_step == 2
    assert any("no optimizer state" in m and "AdamW restarts from zero moments" in m for m in rep.lines)
