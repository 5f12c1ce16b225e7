"""A resumed run is the same run, and every checkpoint value is checked before a byte of the run folder changes."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from icsd_audit.train.loop import train

from .test_loop import bank, tiny_cfg, varied_factory  # noqa: F401  (bank is a fixture)


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, bank: str) -> Path:  # noqa: F811
    """A run of 2 steps with a checkpoint after each (the newest, step-000001, is kept)."""
    run = tmp_path_factory.mktemp("stopped") / "r"
    train(tiny_cfg(run, bank, total_steps=2, checkpoint_every=1), env_factory=varied_factory())
    return run


@pytest.fixture
def run(stopped: Path, tmp_path: Path) -> Path:
    """A fresh copy of the stopped run for a test to damage."""
    import shutil

    dst = tmp_path / "r"
    shutil.copytree(stopped, dst, symlinks=True)
    return dst


def _resume(run: Path, bank: str, **kw):  # noqa: F811
    return train(tiny_cfg(run, bank, **{"total_steps": 3, "checkpoint_every": 1, **kw}), resume=True,
                 env_factory=varied_factory())


def _refused(run: Path, bank: str, exc: type, match: str, **kw) -> str:  # noqa: F811
    before = _files(run)
    with pytest.raises(exc) as err:
        _resume(run, bank, **kw)
    msg = str(err.value)
    assert "\n" not in msg, msg
    import re

    assert re.search(match, msg), msg
    assert _files(run) == before  # nothing deleted, truncated or written
    return msg


# ----------------------------------------------------------------------------- the same run


def test_a_resume_that_changes_what_is_trained_is_refused_naming_old_and_new(run: Path, bank: str) -> None:  # noqa: F811
    from icsd_audit.train.run.folder import RunFolderError

    msg = _refused(run, bank, RunFolderError, r"allocator 'icsd' -> 'sdar'", allocator="sdar")
    assert "checkpoints/step-000001/trainer_state.json" in msg and "total_steps" in msg  # where, and what may change
    _refused(run, bank, RunFolderError, r"seed 0 -> 5", seed=5)
    _refused(run, bank, RunFolderError, r"env 'webshop' -> 'searchqa'", env="searchqa")
    _refused(run, bank, RunFolderError, r"lora_rank 0 -> 2", lora_rank=2)
    msg = _refused(run, bank, RunFolderError, r"trust 'laplace' -> 'sigmoid'", trust="sigmoid", lr=2e-3)
    assert "lr 0.001 -> 0.002" in msg


def test_the_fields_that_may_change_are_listed_once_and_in_the_docs() -> None:
    from icsd_audit.train.config import TrainConfig
    from icsd_audit.train.run.resume import MAY_CHANGE_ON_RESUME

    names = {f for f in TrainConfig().to_dict()}
    assert set(MAY_CHANGE_ON_RESUME) <= names
    doc = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    section = doc[doc.index("### What may change on resume"):]
    section = section[: section.index("\n#", 5)]
    listed = section[section.index("\n* "): section.index("\n\n", section.index("\n* "))]  # the bullet list
    assert sorted(f for f in names if f"`{f}`" in listed) == sorted(MAY_CHANGE_ON_RESUME)


def test_a_resume_that_runs_no_step_changes_nothing(run: Path, bank: str) -> None:  # noqa: F811
    before = _files(run)
    res = _resume(run, bank, total_steps=2, keep_checkpoints=3)
    assert res.start_step == res.next_step == 2 and not res.records
    assert _files(run) == before  # config.json and run.json keep the values the run used


def test_a_lora_run_resumed_without_lora_is_refused_in_one_line(tmp_path: Path, bank: str) -> None:  # noqa: F811
    from icsd_audit.train.run.folder import RunFolderError

    run = tmp_path / "lora"
    train(tiny_cfg(run, bank, total_steps=1, checkpoint_every=1, lora_rank=2, lr=1e-2), env_factory=varied_factory())
    _refused(run, bank, RunFolderError, r"lora_rank 2 -> 0")


# ----------------------------------------------------------------------------- no checkpoint


def test_resume_without_a_checkpoint_refuses_to_redo_complete_steps(tmp_path: Path, bank: str) -> None:  # noqa: F811
    from icsd_audit.train.run.folder import RunFolderError

    run = tmp_path / "r"
    train(tiny_cfg(run, bank, total_steps=2), env_factory=varied_factory())  # checkpoint only at the end
    import shutil

    shutil.rmtree(run / "checkpoints")
    msg = _refused(run, bank, RunFolderError, r"holds 2 completed step\(s\) \(0\.\.1\) but no checkpoint")
    assert "--overwrite" in msg


def test_resume_without_a_checkpoint_or_a_complete_step_starts_at_step_0(tmp_path: Path, bank: str) -> None:  # noqa: F811
    run = tmp_path / "r"
    run.mkdir()
    tiny_cfg(run, bank, total_steps=1).save(run / "config.json")  # a run stopped before its first step completed
    res = _resume(run, bank, total_steps=1)
    assert res.start_step == 0 and res.next_step == 1


def test_the_stop_line_without_a_checkpoint_suggests_a_command_that_loses_nothing(tmp_path: Path) -> None:
    from icsd_audit.train.run.folder import stop_line

    line = stop_line("SIGTERM", out=tmp_path / "r", started=True, step=3, first=0, done=3, checkpoint=None,
                     resume_command="icsd train --out r --resume", fresh_command="icsd train --out r --overwrite")
    assert "continue with" not in line and "--resume" not in line
    assert "start again with: icsd train --out r --overwrite (steps 0..2 move to r.old-<date>" in line
    line = stop_line("SIGTERM", out=tmp_path / "r", started=True, step=0, first=0, done=0, checkpoint=None,
                     resume_command="icsd train --out r --resume")
    assert "continue with: icsd train --out r --resume (from step 0: no checkpoint yet)" in line


# ----------------------------------------------------------------------------- the trainer state


def _edit_state(run: Path, edit) -> None:
    f = run / "checkpoints" / "step-000001" / "trainer_state.json"
    doc = json.loads(f.read_text())
    out = edit(doc)
    f.write_text(out if isinstance(out, str) else json.dumps(doc))


@pytest.mark.parametrize("raw, want", [
    ("-3", r"next_step is -3; a checkpoint holds an integer from 1 to 1000000000"),
    ("1e30", r"next_step is 1e\+30"),
    ("1000000000000000000000000000000", r"next_step is 10+; a checkpoint holds an integer"),
    ("NaN", r"trainer_state.json: next_step is nan, not a finite number"),
    ("Infinity", r"trainer_state.json: next_step is inf, not a finite number"),
    ('"2"', r"next_step is '2'"),
    ("true", r"next_step is True"),
    ("5", r"next_step is 5, but the folder step-000001 is the checkpoint taken after step 1 \(next_step 2\)"),
])
def test_a_bad_next_step_is_refused_before_anything_changes(run: Path, bank: str, raw: str, want: str) -> None:  # noqa: F811
    from icsd_audit.train.run.checkpoint import CheckpointError

    _edit_state(run, lambda d: json.dumps(d).replace('"next_step": 2', f'"next_step": {raw}'))
    _refused(run, bank, CheckpointError, want)


def test_deeply_nested_state_and_config_are_one_line(run: Path, bank: str) -> None:  # noqa: F811
    from icsd_audit.train.run.checkpoint import CheckpointError
    from icsd_audit.train.models.loading import ModelLoadError

    deep = "[" * 100_000 + "]" * 100_000
    ck = run / "checkpoints" / "step-000001"
    saved = (ck / "trainer_state.json").read_text()
    (ck / "trainer_state.json").write_text(saved[:-2] + f', "extra": {deep}}}')
    _refused(run, bank, CheckpointError, r"trainer_state.json: nested too deeply to read")
    (ck / "trainer_state.json").write_text(saved[:-2] + ', "extra": ' + "[" * 80 + "]" * 80 + "}")
    _refused(run, bank, CheckpointError, r"trainer_state.json: nested more than 64 levels deep at extra\.0\.0")
    (ck / "trainer_state.json").write_text(saved)
    (ck / "config.json").write_text(deep)
    _refused(run, bank, ModelLoadError, r"step-000001/config.json: nested too deeply to read")


def test_crafted_types_in_the_state_are_refused(run: Path, bank: str) -> None:  # noqa: F811
    from icsd_audit.train.run.checkpoint import CheckpointError

    ck = run / "checkpoints" / "step-000001" / "trainer_state.json"
    saved = ck.read_text()

    def put(path: list, value) -> None:
        doc = json.loads(saved)
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        ck.write_text(json.dumps(doc))

    put(["rng", "numpy"], {"__tuple__": ["MT19937", {"__ndarray__": [1, 2], "dtype": "not-a-dtype"}, 0, 0, 0.0]})
    _refused(run, bank, CheckpointError, r"trainer_state.json: not a trainer state icsd wrote \(data type")
    put(["rng", "numpy"], {"__tuple__": ["MT19937", [1, 2], 0, 0, 0.0]})
    _refused(run, bank, CheckpointError, r"trainer_state.json: rng is not a generator state")
    put(["rng", "python"], 7)
    _refused(run, bank, CheckpointError, r"rng is not a generator state")
    put(["rng"], [1, 2])
    _refused(run, bank, CheckpointError, r"rng does not hold the python, numpy and torch generator states")
    put(["optimizer"], 5)
    _refused(run, bank, CheckpointError, r"optimizer is not AdamW's state")
    put(["optimizer", "state", "0", "exp_avg"], [0.0, 1.0])
    _refused(run, bank, CheckpointError, r"optimizer.state.0.exp_avg is a list; AdamW keeps finite floating-point")
    put(["optimizer", "state", "x"], {})
    _refused(run, bank, CheckpointError, r"optimizer.state has keys .*'x'.*, not parameter numbers")
    put(["optimizer", "param_groups", 0, "params"], [0, 1])
    _refused(run, bank, CheckpointError, r"its optimizer state is for 2 parameter tensors; this model trains \d+")
    put(["config"], "x")
    _refused(run, bank, CheckpointError, r"config is str, not the run's configuration")


def test_a_crafted_optimizer_dtype_is_refused(run: Path, bank: str) -> None:  # noqa: F811
    from safetensors.torch import load_file, save_file

    from icsd_audit.train.run.checkpoint import CheckpointError

    f = run / "checkpoints" / "step-000001" / "trainer_state.safetensors"
    t = load_file(str(f))
    key = next(k for k in t if k.endswith("exp_avg"))
    t[key] = t[key].to(dtype=__import__("torch").int32)
    save_file(t, str(f))
    _refused(run, bank, CheckpointError, r"optimizer.state.\d+.exp_avg is a torch.int32 tensor")


def test_a_metrics_log_that_cannot_be_kept_is_refused_before_anything_changes(run: Path, bank: str) -> None:  # noqa: F811
    saved = (run / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").write_bytes(b"\xff\xfe\x00binary" + saved)
    _refused(run, bank, ValueError, r"metrics.jsonl: not a UTF-8 JSONL log \(byte 0\)")
    (run / "metrics.jsonl").write_bytes(b'{"step": NaN}\n' + saved)
    _refused(run, bank, ValueError, r"metrics.jsonl: line 1: step is nan, not an integer step number")


# ----------------------------------------------------------------------------- the weights: a strict load


def _weights(run: Path) -> Path:
    return run / "checkpoints" / "step-000001" / "model.safetensors"


def test_missing_unexpected_or_misshaped_tensors_are_refused(run: Path, bank: str) -> None:  # noqa: F811
    import torch
    from safetensors.torch import load_file, save_file

    from icsd_audit.train.models.loading import ModelLoadError

    f = _weights(run)
    saved = f.read_bytes()
    t = load_file(str(f))
    name = sorted(k for k in t if k.endswith("q_proj.weight"))[0]
    save_file({k: v for k, v in t.items() if k != name}, str(f), metadata={"format": "pt"})
    _refused(run, bank, ModelLoadError, rf"1 missing tensor\(s\) \({name}\); refusing to fill them at random")
    save_file({**t, "model.extra.weight": torch.zeros(2)}, str(f), metadata={"format": "pt"})
    _refused(run, bank, ModelLoadError, r"1 unexpected tensor\(s\) \(model.extra.weight\)")
    save_file({**t, name: torch.zeros(3, 5)}, str(f), metadata={"format": "pt"})
    _refused(run, bank, ModelLoadError, rf"1 mismatched tensor\(s\) \({name}: \(3, 5\) in the file, \(32, 32\) in the model\)")
    f.write_bytes(saved)


def test_crafted_weight_files_are_one_line(run: Path, bank: str, tmp_path: Path) -> None:  # noqa: F811
    from icsd_audit.train.models.loading import ModelLoadError

    f = _weights(run)
    body = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 2**60) + body[8:])
    _refused(run, bank, ModelLoadError, r"model.safetensors: not a safetensors file: its header claims 1152921504606846976")
    n = struct.unpack("<Q", body[:8])[0]
    header = json.loads(body[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10**12]
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + body[8 + n:])
    _refused(run, bank, ModelLoadError, rf"tensor '{name}' has data_offsets \[0, 1000000000000\] outside the file")
    header[name]["data_offsets"], header[name]["dtype"] = [0, 4], "Q9"
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + body[8 + n:])
    _refused(run, bank, ModelLoadError, rf"tensor '{name}' has dtype 'Q9', not a safetensors dtype")
    other = tmp_path / "notes.txt"
    other.write_text("just some text, not weights at all\n" * 10)
    f.unlink()
    f.symlink_to(other)
    _refused(run, bank, ModelLoadError, r"model.safetensors: not a safetensors file")
    (run / "checkpoints" / "step-000001" / "trainer_state.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    from icsd_audit.train.run.checkpoint import CheckpointError

    _refused(run, bank, CheckpointError, r"trainer_state.safetensors: not a safetensors file")


# ----------------------------------------------------------------------------- bit-identical


def test_a_resumed_run_writes_the_uninterrupted_runs_config_and_run_json(stopped: Path, run: Path, tmp_path: Path,
                                                                        bank: str) -> None:  # noqa: F811
    straight = train(tiny_cfg(tmp_path / "a", bank, total_steps=3, checkpoint_every=1), env_factory=varied_factory())
    res = _resume(run, bank, total_steps=3, threads=2)  # threads may change: the config records the run's own
    assert res.start_step == 2 and res.next_step == 3
    a, b = straight.out_dir, run
    assert json.loads((b / "config.json").read_text()) == {**json.loads((a / "config.json").read_text()),
                                                           "out_dir": str(b), "threads": 2}
    ra, rb = (json.loads((x / "run.json").read_text()) for x in (a, b))
    assert len(rb["sessions"]) == 2 and rb["sessions"][0]["end_step"] == 2
    for key in ("engine", "seed", "status", "completed_steps", "total_steps"):
        assert ra[key] == rb[key], key
    assert rb["config"] == json.loads((b / "config.json").read_text())
