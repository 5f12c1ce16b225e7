"""``icsd train | eval | sft``: each bad option, environment variable or input file is one line, exit 2, no traceback,
and nothing written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from icsd_audit.cli.main import app


def _one_line(res, want: str) -> str:
    out = res.output.strip()
    assert res.exit_code == 2, out[-2000:]
    assert len(out.splitlines()) == 1 and "Traceback" not in out, out[-2000:]
    assert want in out, out
    return out


def _model(folder: Path) -> Path:
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    m, tok = tiny_random_causal_lm(seed=0)
    m.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def _adapter(folder: Path) -> Path:
    from icsd_audit.train.models import lora as lo
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    m, _ = tiny_random_causal_lm(seed=0)
    lo.AdapterSaver(lo.add_adapter(m, lo.LoraSettings(rank=2, alpha=4.0, targets="all-linear")),
                    lo.adapter_meta(base_model="tiny-random", base_seed=0,
                                    settings=lo.LoraSettings(rank=2, alpha=4.0, targets="all-linear"),
                                    producer="test", init=None)).save_pretrained(str(folder))
    return folder


def _huge_header(f: Path) -> None:
    body = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 2**60) + body[8:])


def test_set_of_a_field_a_flag_also_sets_is_refused(tmp_path: Path) -> None:
    x, y = tmp_path / "X", tmp_path / "Y"
    res = CliRunner().invoke(app, ["train", "--model", "tiny-random", "--set", f"out_dir={x}", "--out", str(y)])
    _one_line(res, f"--set out_dir={x} contradicts --out (both set out_dir: '{x}' and '{y}'); pass one")
    assert not x.exists() and not y.exists()
    res = CliRunner().invoke(app, ["train", "--model", "tiny-random", "--out", str(y), "--set", "allocator=sdar",
                                   "--allocator", "icsd"])
    _one_line(res, "--set allocator=sdar contradicts --allocator (both set allocator: 'sdar' and 'icsd')")
    res = CliRunner().invoke(app, ["train", "--model", "tiny-random", "--out", str(y), "--set", "seed=1",
                                   "--set", "seed=2"])
    _one_line(res, "--set seed=2 contradicts --set seed=1")
    assert not y.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_in_train_eval_and_sft(tmp_path: Path) -> None:
    want = "device 'cuda' requested but CUDA is not available"
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", "--model", "tiny-random", "--out", str(out), "--device", "cuda",
                                   "--steps", "1", "--plain"])
    _one_line(res, want)
    assert not out.exists()
    res = CliRunner().invoke(app, ["eval", "--model", "tiny-random", "--device", "cuda", "--tasks", "1"])
    _one_line(res, want)
    res = CliRunner().invoke(app, ["sft", "--model", "tiny-random", "--out", str(tmp_path / "sft"), "--set",
                                   "device=cuda", "--episodes", "2", "--heldout-episodes", "1", "--tasks", "0",
                                   "--epochs", "1"])
    _one_line(res, want)
    assert list(tmp_path.iterdir()) == []  # no run folder, no staging folder


def test_icsd_threads_above_the_cap_is_refused_before_any_work(tmp_path: Path) -> None:
    for cmd in (["train", "--model", "tiny-random", "--out", str(tmp_path / "r")],
                ["eval", "--model", "tiny-random", "--tasks", "1"],
                ["sft", "--model", "tiny-random", "--out", str(tmp_path / "s")]):
        res = CliRunner().invoke(app, cmd, env={"ICSD_THREADS": "10000"})
        _one_line(res, "ICSD_THREADS=10000: must lie in 1..256")
    assert list(tmp_path.iterdir()) == []


def test_out_dot_with_overwrite_is_refused_and_leaves_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text("{}\n")  # the shell's folder holds a run
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["train", "--model", "tiny-random", "--out", ".", "--overwrite"])
    _one_line(res, "--out . --overwrite: ")
    assert "is this shell's folder or holds it, so it cannot be moved aside" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_crafted_weight_files_are_one_line_in_eval_and_init(tmp_path: Path) -> None:
    model = _model(tmp_path / "M")
    _huge_header(model / "model.safetensors")
    res = CliRunner().invoke(app, ["eval", "--model", str(model), "--tasks", "1"])
    _one_line(res, f"{model / 'model.safetensors'}: not a safetensors file: its header claims 1152921504606846976")
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", "--model", "tiny-random", "--init", str(model), "--out", str(out),
                                   "--steps", "1", "--plain"])
    _one_line(res, "its header claims 1152921504606846976")
    assert not out.exists()

    deep = _model(tmp_path / "D")
    (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    res = CliRunner().invoke(app, ["eval", "--model", str(deep), "--tasks", "1"])
    _one_line(res, f"{deep / 'config.json'}: nested too deeply to read")

    adapter = _adapter(tmp_path / "A")
    notes = tmp_path / "notes.txt"
    notes.write_text("not weights\n" * 20)
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").symlink_to(notes)
    res = CliRunner().invoke(app, ["eval", "--adapter", str(adapter), "--tasks", "1"])
    _one_line(res, f"{adapter / 'adapter_model.safetensors'}: not a safetensors file")


def test_an_adapter_with_a_missing_tensor_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    adapter = _adapter(tmp_path / "A")
    f = adapter / "adapter_model.safetensors"
    t = load_file(str(f))
    gone = sorted(t)[0]
    save_file({k: v for k, v in t.items() if k != gone}, str(f))
    res = CliRunner().invoke(app, ["eval", "--adapter", str(adapter), "--tasks", "1"])
    _one_line(res, f"{f}: 1 missing tensor(s) ({gone})")
    save_file({**t, "base_model.model.extra.lora_A.weight": torch.zeros(2)}, str(f))
    res = CliRunner().invoke(app, ["eval", "--adapter", str(adapter), "--tasks", "1"])
    _one_line(res, f"{f}: 1 unexpected tensor(s) (base_model.model.extra.lora_A.weight)")


def test_resume_with_another_allocator_is_one_line_naming_the_field(tmp_path: Path) -> None:
    from icsd_audit.train.config import from_preset

    run = tmp_path / "r"
    run.mkdir()
    args = ["train", "--model", "tiny-random", "--out", str(run), "--steps", "1", "--plain", "--set", "threads=1"]
    cfg = from_preset("cpu-demo", model="tiny-random", out_dir=str(run), total_steps=1, threads=1)
    cfg.save(run / "config.json")  # a run stopped before its first step
    before = (run / "config.json").read_bytes()
    res = CliRunner().invoke(app, args + ["--resume", "--allocator", "sdar"])
    _one_line(res, "--resume: this command would change what the run in")
    assert "allocator 'icsd' -> 'sdar'" in res.output and f"{run / 'config.json'}" in res.output
    assert (run / "config.json").read_bytes() == before and sorted(p.name for p in run.iterdir()) == ["config.json"]
    assert json.loads(before)["allocator"] == "icsd"


def test_the_stop_lines_commands_swap_resume_and_overwrite(monkeypatch: pytest.MonkeyPatch) -> None:
    from icsd_audit.cli.train import resume_command

    monkeypatch.setattr("sys.argv", ["icsd", "train", "--out", "r", "--overwrite", "--resume-from", "c", "--steps", "3"])
    assert resume_command() == "icsd train --out r --steps 3 --resume"
    assert resume_command("--overwrite") == "icsd train --out r --steps 3 --overwrite"
    monkeypatch.setattr("sys.argv", ["icsd", "train", "--out", "r b", "--resume"])
    assert resume_command("--overwrite") == "icsd train --out 'r b' --overwrite"
