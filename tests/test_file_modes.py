"""Every file and folder the toolkit writes gets the user's umask, like a plain ``open``/``mkdir`` (issue 24 item 9).

Checkpoints were ``drwx------`` with ``-rw-------`` weights (mkdtemp, safetensors) while
everything else was 0644; a figure or manifest was 0644 whatever the umask said.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_checkpoint_files_and_folders_follow_the_umask(tmp_path: Path, mask: int) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from icsd_audit.train.run.checkpoint import save_checkpoint
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    model, tok = tiny_random_causal_lm(seed=0)
    with umask(mask):
        path = save_checkpoint(tmp_path / "run", next_step=1, model=model, tokenizer=tok,
                               optimizer=torch.optim.AdamW(model.parameters()), config={})
    got = modes(path)
    assert "model.safetensors" in got and "trainer_state.safetensors" in got
    for name, mode in got.items():
        want = (0o777 if name == "." else 0o666) & ~mask
        assert mode == want, (name, oct(mode), oct(want))
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o777 & ~mask


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_figures_manifests_and_text_files_follow_the_umask(tmp_path: Path, mask: int) -> None:
    from icsd_audit.outputs import umask_mode, write_text_atomic
    from icsd_audit.report.figures.style import new_figure, save_figure

    with umask(mask):
        fig = new_figure()
        fig.add_subplot().plot([0, 1], [0, 1])
        save_figure(fig, tmp_path / "f.png")
        write_text_atomic(tmp_path / "t.txt", "x\n")
        script = tmp_path / "s.sh"
        script.write_text("#!/bin/sh\n")
        umask_mode(script, executable=True)
    for name in ("f.png", "t.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask, name
    assert stat.S_IMODE(script.stat().st_mode) == 0o777 & ~mask


def test_run_manifest_follows_the_umask(tmp_path: Path) -> None:
    from icsd_audit.runs import manifest

    writer = getattr(manifest, "_write_atomic")
    with umask(0o027):
        writer(tmp_path / "run.json", {"a": 1})
    assert stat.S_IMODE((tmp_path / "run.json").stat().st_mode) == 0o640
