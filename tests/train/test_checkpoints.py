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
    from icsd_audit.train.run.checkpoint import TENSOR_FILE, load_trainer_state

    sf, sl = (load_trainer_state(r.checkpoint) for r in (full, lean))
    assert sf["optimizer"]["state"] and sl["optimizer"] is None and sl["next_step"] == 1
    assert (lean.checkpoint / TENSOR_FILE).stat().st_size < (full.checkpoint / TENSOR_FILE).stat().st_size
    rep = Messages()
    resumed = train(tiny_cfg(tmp_path / "lean", bank, total_steps=2, checkpoint_every=1, checkpoint_optimizer=False),
                    resume=True, reporter=rep, env_factory=varied_factory())
    assert resumed.start_step == 1 and resumed.next_step == 2
    assert any("no optimizer state" in m and "AdamW restarts from zero moments" in m for m in rep.lines)


# ----------------------------------------------------------------------------- the format: no pickles


class _Saver:
    """Stands in for a model / tokenizer: ``save_pretrained`` writes one small file."""

    def __init__(self, name: str) -> None:
        self.name = name

    def save_pretrained(self, folder: str, **kw) -> None:
        (Path(folder) / self.name).write_text("{}")


def _trained_optimizer() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.8, 0.95))
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return opt


def test_trainer_state_round_trips_without_pickle(tmp_path: Path) -> None:
    import json
    import random

    import numpy as np

    from icsd_audit.train.run.checkpoint import STATE_FILE, TENSOR_FILE, load_trainer_state, save_checkpoint

    opt = _trained_optimizer()
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    ck = save_checkpoint(tmp_path, next_step=4, model=_Saver("config.json"), tokenizer=_Saver("tokenizer.json"),
                         optimizer=opt, config={"lr": 1e-3, "name": "x"}, extra={"note": (1, 2)})
    want = (random.random(), float(np.random.random()), float(torch.rand(())))
    assert sorted(p.name for p in ck.iterdir()) == ["config.json", "tokenizer.json", STATE_FILE, TENSOR_FILE]
    assert not list(ck.glob("*.pt"))
    doc = json.loads((ck / STATE_FILE).read_text())
    assert doc["format"] == "icsd.trainer_state" and doc["next_step"] == 4
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    state = load_trainer_state(ck)
    assert state["next_step"] == 4 and state["config"] == {"lr": 1e-3, "name": "x"} and state["note"] == (1, 2)
    ref = opt.state_dict()
    got = state["optimizer"]
    assert got["param_groups"] == ref["param_groups"] and isinstance(got["param_groups"][0]["betas"], tuple)
    assert sorted(got["state"]) == sorted(ref["state"]) == [0, 1, 2, 3]
    for pid, s in ref["state"].items():
        assert sorted(got["state"][pid]) == sorted(s)
        for k, v in s.items():
            assert got["state"][pid][k].dtype == v.dtype and torch.equal(got["state"][pid][k], v)
    # the loaded optimizer state drives a fresh optimizer to the same next step
    from icsd_audit.train.run.checkpoint import set_rng_state

    set_rng_state(state["rng"])
    assert (random.random(), float(np.random.random()), float(torch.rand(()))) == want


def test_a_legacy_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    import os
    import pickle

    import pytest

    from icsd_audit.train.run.checkpoint import LEGACY_STATE_FILE, CheckpointError, load_trainer_state

    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ck = tmp_path / "checkpoints" / "step-000000"
    ck.mkdir(parents=True)
    with open(ck / LEGACY_STATE_FILE, "wb") as fh:
        pickle.dump({"next_step": 1, "optimizer": None, "rng": Evil(), "config": {}}, fh)
    with pytest.raises(CheckpointError) as err:
        load_trainer_state(ck)
    assert not marker.exists()
    msg = str(err.value)
    assert "\n" not in msg and str(ck / LEGACY_STATE_FILE) in msg and "refused" in msg and "could run code" in msg


def test_a_legacy_checkpoint_of_plain_data_still_loads(tmp_path: Path) -> None:
    import numpy as np

    from icsd_audit.train.run.checkpoint import LEGACY_STATE_FILE, latest_checkpoint, load_trainer_state, rng_state

    opt = _trained_optimizer()
    ck = tmp_path / "checkpoints" / "step-000002"
    ck.mkdir(parents=True)
    torch.save({"next_step": 3, "optimizer": opt.state_dict(), "rng": rng_state(), "config": {"seed": 0}},
               ck / LEGACY_STATE_FILE)
    assert latest_checkpoint(tmp_path) == ck
    state = load_trainer_state(ck)
    assert state["next_step"] == 3 and isinstance(state["rng"]["numpy"][1], np.ndarray)
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path: Path) -> None:
    from icsd_audit.train.run.checkpoint import latest_checkpoint, save_checkpoint

    opt = _trained_optimizer()
    kw = dict(model=_Saver("config.json"), tokenizer=_Saver("tokenizer.json"), optimizer=opt, config={})
    save_checkpoint(tmp_path, next_step=3, keep=1, **kw)
    save_checkpoint(tmp_path, next_step=10, keep=1, **kw)  # step-000009 sorts after step-000002 by number
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000009"]
    # a checkpoint of an earlier step written after a later one (a resumed branch) is kept, the later one pruned
    new = save_checkpoint(tmp_path, next_step=5, keep=1, **kw)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000004"] and new.is_dir()
    assert latest_checkpoint(tmp_path) == new
    kept = save_checkpoint(tmp_path, next_step=6, keep=2, **kw)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000004", "step-000005"]
    assert kept.name == "step-000005"


def test_a_killed_save_leaves_a_staging_folder_that_the_next_save_removes(tmp_path: Path) -> None:
    import subprocess
    import sys

    from icsd_audit.outputs import staging_dir
    from icsd_audit.train.run.checkpoint import latest_checkpoint, save_checkpoint

    # a staging folder named by a process that no longer runs, as a SIGKILLed save leaves it
    code = ("import sys; from pathlib import Path; from icsd_audit.outputs import staging_dir; "
            "print(staging_dir(Path(sys.argv[1]) / 'checkpoints' / 'step-000000', 'ckpt'))")
    left = Path(subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                               check=True).stdout.strip())
    assert left.is_dir() and left.name.startswith(".step-000000.icsd-ckpt-")
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, next_step=1, model=_Saver("config.json"), tokenizer=_Saver("t.json"),
                    optimizer=_trained_optimizer(), config={})
    assert not left.exists() and [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000000"]
    assert staging_dir  # imported for the name check above


def test_model_folders_run_no_shipped_code_unless_asked(tmp_path: Path) -> None:
    import json

    import pytest

    from icsd_audit.train.models.loading import load_model, tiny_random_causal_lm

    folder = tmp_path / "model"
    folder.mkdir()
    tiny_random_causal_lm(seed=0)[1].save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "shipped", "architectures": ["Shipped"],
        "auto_map": {"AutoConfig": "shipped.Config", "AutoModelForCausalLM": "shipped.Model"}}))
    marker = tmp_path / "RAN"
    (folder / "shipped.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(folder)
    assert not marker.exists()
    with pytest.raises(Exception):  # noqa: B017  (asked for: the shipped module is imported, then lacks its classes)
        load_model(folder, trust_remote_code=True)
    assert marker.exists()
