"""A training run is never lost or half-written (issue 21): run folders, signals, step commits, checks up front."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from icsd_audit.train.loop import TrainingStopped, train

from .test_loop import bank, tiny_cfg, varied_factory  # noqa: F401  (bank is a fixture)


def _files(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) -> its content hash."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _steps(run: Path, name: str = "metrics.jsonl") -> list[int]:
    return [json.loads(line)["step"] for line in (run / name).read_text().splitlines()]


def _signal_after_shard(monkeypatch: pytest.MonkeyPatch, signum: int, name: str) -> None:
    """Send ``signum`` to this process right after the dump shard ``name`` is written: a deterministic point."""
    from icsd_audit.dumps import writer as w

    write = w.DumpWriter.write

    def patched(self, **kw):
        path = write(self, **kw)
        if kw.get("name") == name:
            os.kill(os.getpid(), signum)
        return path

    monkeypatch.setattr(w.DumpWriter, "write", patched)


def _strip_times(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def _tables(dumps: Path) -> dict[int, object]:
    from icsd_audit.dumps.reader import DumpReader

    return {b.batch_id: b.table for b in DumpReader([dumps], columns=None)}


# ----------------------------------------------------------------------------- signals and resume


def test_sigterm_mid_step_then_resume_gives_the_uninterrupted_run(tmp_path: Path, bank: str,  # noqa: F811
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    kw = dict(total_steps=3, checkpoint_every=1)
    straight = train(tiny_cfg(tmp_path / "a", bank, **kw), env_factory=varied_factory())
    run = tmp_path / "b"
    _signal_after_shard(monkeypatch, signal.SIGTERM, "step000001-mb000.parquet")
    with pytest.raises(TrainingStopped) as err:
        train(tiny_cfg(run, bank, **kw), env_factory=varied_factory())
    stop = err.value
    assert stop.exit_code == 143 and stop.step == 1 and stop.done == 1
    line = stop.line("icsd train --out b --resume")
    assert "\n" not in line and line.startswith("stopped by SIGTERM during step 1; steps 0..0 are complete")
    assert "continue with: icsd train --out b --resume (from checkpoints/step-000000)" in line
    # the step in progress left nothing: its one written shard was staged and dropped, no temporaries remain
    assert sorted(p.name for p in (run / "dumps").iterdir()) == ["step000000"]
    assert _steps(run) == [0] and sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000000"]
    assert [p.name for p in run.rglob(".*")] == [".icsd-run.lock"]
    monkeypatch.undo()

    resumed = train(tiny_cfg(run, bank, **kw), resume=True, env_factory=varied_factory())
    assert resumed.start_step == 1 and resumed.next_step == 3
    a, b = straight.out_dir / "metrics.jsonl", run / "metrics.jsonl"
    assert _strip_times([json.loads(x) for x in b.read_text().splitlines()]) == \
        _strip_times([json.loads(x) for x in a.read_text().splitlines()])
    ta, tb = _tables(straight.dumps_dir), _tables(run / "dumps")
    assert sorted(ta) == sorted(tb) == [0, 1, 1000, 1001, 2000, 2001]  # two mini-batches a step
    for k in ta:
        assert ta[k].equals(tb[k]), k
    assert sorted(p.name for p in (run / "dumps").iterdir()) == ["step000000", "step000001", "step000002"]
    # the configuration recorded is the uninterrupted run's (out_dir apart), in config.json and run.json
    ca, cb = (json.loads((r / "config.json").read_text()) for r in (straight.out_dir, run))
    assert cb == {**ca, "out_dir": str(run)}
    ja, jb = (json.loads((r / "run.json").read_text()) for r in (straight.out_dir, run))
    assert jb["config"] == cb and ja["config"] == ca
    assert [(j["seed"], j["status"], j["completed_steps"], j["total_steps"]) for j in (ja, jb)] == [(0, "finished", 3, 3)] * 2


def test_sigint_during_a_checkpoint_lets_it_finish_then_stops(tmp_path: Path, bank: str,  # noqa: F811
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from icsd_audit.train import loop
    from icsd_audit.train.run.checkpoint import latest_checkpoint, load_trainer_state

    save = loop.save_checkpoint

    def interrupted(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # arrives before the checkpoint is written
        return save(*a, **kw)

    monkeypatch.setattr(loop, "save_checkpoint", interrupted)
    run = tmp_path / "r"
    with pytest.raises(TrainingStopped) as err:
        train(tiny_cfg(run, bank, total_steps=3, checkpoint_every=1), env_factory=varied_factory())
    assert err.value.exit_code == 130 and err.value.done == 1
    assert "stopped by SIGINT during step 0; steps 0..0 are complete" in err.value.line()
    ck = latest_checkpoint(run)
    assert ck is not None and ck.name == "step-000000" and load_trainer_state(ck)["next_step"] == 1
    assert _steps(run) == [0] and sorted(p.name for p in (run / "dumps").iterdir()) == ["step000000"]


def test_a_stop_before_the_run_starts_writes_nothing(tmp_path: Path, bank: str,  # noqa: F811
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from icsd_audit.train import setup

    load = setup.load_policy

    def interrupted(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        return load(*a, **kw)

    monkeypatch.setattr(setup, "load_policy", interrupted)
    with pytest.raises(TrainingStopped) as err:
        train(tiny_cfg(tmp_path / "r", bank), env_factory=varied_factory())
    assert err.value.exit_code == 143 and not err.value.started
    assert err.value.line() == f"stopped by SIGTERM before the run started: nothing was written to {tmp_path / 'r'}"
    assert not (tmp_path / "r").exists()


KILLED_RUN = r"""
import os, signal, sys
from icsd_audit.dumps import writer as w
sys.path.insert(0, sys.argv[3])
from tests.train.test_loop import tiny_cfg, varied_factory
from icsd_audit.train.loop import train
write = w.DumpWriter.write
def patched(self, **kw):
    path = write(self, **kw)
    if kw.get("name") == "step000001-mb001.parquet":
        os.kill(os.getpid(), signal.SIGKILL)  # no handler runs: what a power cut or the OOM killer leaves
    return path
w.DumpWriter.write = patched
train(tiny_cfg(sys.argv[1], sys.argv[2], total_steps=3, checkpoint_every=1), env_factory=varied_factory())
"""


def test_a_killed_run_leaves_an_uncommitted_step_that_readers_skip_and_resume_removes(
        tmp_path: Path, bank: str) -> None:  # noqa: F811
    from icsd_audit.dumps.reader import DumpReader, DumpWarning

    run = tmp_path / "r"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, str(run), bank, str(root)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    staged = [p for p in (run / "dumps").iterdir() if p.name.startswith(".step000001.icsd-step-")]
    assert len(staged) == 1 and sorted(p.name for p in staged[0].glob("*.parquet")) == [
        "step000001-mb000.parquet", "step000001-mb001.parquet"]
    # what an older version left behind after a kill: a shard's and a checkpoint's temporaries
    (run / "dumps" / ".step000001-mb002.parquet.k2j4s8.tmp").write_bytes(b"PAR1")
    (run / "checkpoints" / ".step-000001.tmp-x81ja").mkdir()
    with pytest.warns(DumpWarning, match=r"uncommitted step000001 \(its writer stopped") as seen:
        batches = [b.batch_id for b in DumpReader([run / "dumps"])]
    assert batches == [0, 1] and len([w for w in seen if "uncommitted" in str(w.message)]) == 1

    resumed = train(tiny_cfg(run, bank, total_steps=3, checkpoint_every=1), resume=True, env_factory=varied_factory())
    assert resumed.start_step == 1 and _steps(run) == [0, 1, 2]
    assert [p.name for p in run.rglob(".*")] == [".icsd-run.lock"]
    assert sorted(p.name for p in (run / "dumps").iterdir()) == ["step000000", "step000001", "step000002"]


# ----------------------------------------------------------------------------- run folders


def test_a_new_run_into_a_run_folder_is_refused_and_overwrite_moves_it_aside(tmp_path: Path,
                                                                             bank: str) -> None:  # noqa: F811
    from icsd_audit.train.run.folder import RunFolderError

    run = tmp_path / "R"
    train(tiny_cfg(run, bank, total_steps=2, checkpoint_every=1), env_factory=varied_factory())
    before = _files(run)
    with pytest.raises(RunFolderError) as err:
        train(tiny_cfg(run, bank, total_steps=1), env_factory=varied_factory())
    msg = str(err.value)
    assert "\n" not in msg and "holds another run" in msg and "--resume" in msg and "--overwrite" in msg
    assert _files(run) == before  # nothing written, nothing deleted
    res = train(tiny_cfg(run, bank, total_steps=1), env_factory=varied_factory(), overwrite=True)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("R.old-")]
    assert len(aside) == 1 and _files(aside[0]) == before  # the old run, every byte, under a dated name
    assert _steps(run) == [0] and res.checkpoint is not None and res.checkpoint.name == "step-000000"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000000"]


def test_out_that_is_or_holds_an_input_is_refused_before_anything_is_written(tmp_path: Path,
                                                                             bank: str) -> None:  # noqa: F811
    from icsd_audit.outputs import OutputError
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    model = tmp_path / "M"
    m, tok = tiny_random_causal_lm(seed=0)
    m.save_pretrained(str(model))
    tok.save_pretrained(str(model))
    before = _files(model)
    with pytest.raises(OutputError, match=r"--out is the input model folder"):
        train(tiny_cfg(model, bank, model=str(model)), env_factory=varied_factory())
    with pytest.raises(OutputError, match=r"--out holds the input model folder"):
        train(tiny_cfg(tmp_path, bank, model=str(model)), env_factory=varied_factory())
    with pytest.raises(OutputError, match=r"--out lies inside the input model folder"):
        train(tiny_cfg(model / "run", bank, model=str(model)), env_factory=varied_factory())
    assert _files(model) == before


def test_train_checks_every_value_before_writing_its_first_byte(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from icsd_audit.cli.main import app

    out = tmp_path / "run"
    cases = {
        ("--seed", "-1"): "--seed: seed=-1 must be an integer in 0..4294967295",
        ("--seed", "99999999999999999999"): "--seed: seed=99999999999999999999 must be an integer in 0..4294967295",
        ("--set", "lr=inf"): "--set lr=inf: lr=inf must be a finite number",
        ("--set", "distill_coef=inf"): "--set distill_coef=inf: distill_coef=inf must be a finite number",
        ("--set", "temperature=nan"): "--set temperature=nan: temperature=nan must be a finite number",
        ("--set", "kl_coef=-inf"): "--set kl_coef=-inf: kl_coef=-inf must be a finite number",
        ("--steps", "0"): "--steps: total_steps=0 must be an integer >= 1",
    }
    for args, want in cases.items():
        res = CliRunner().invoke(app, ["train", "--model", "tiny-random", "--out", str(out), *args])
        assert res.exit_code == 2 and want in res.output and len(res.output.strip().splitlines()) == 1, res.output
        assert not out.exists()


def test_retriever_url_is_probed_at_start_and_a_corpus_beside_it_is_contradictory(tmp_path: Path,
                                                                                  bank: str) -> None:  # noqa: F811
    from icsd_audit.train.config import ConfigError

    dead = "http://127.0.0.1:9"
    with pytest.raises(ConnectionError, match=r"retriever_url: retrieval server .* unreachable.*probed once at start"):
        train(tiny_cfg(tmp_path / "r", bank, env="searchqa", retriever_url=dead))
    assert not (tmp_path / "r").exists()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1", "contents": "a"}\n')
    with pytest.raises(ConfigError, match="contradict each other"):
        tiny_cfg(tmp_path / "r", bank, env="searchqa", retriever_url=dead, searchqa_corpus=str(corpus)).validate()


def test_resuming_from_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    import pickle

    from typer.testing import CliRunner

    from icsd_audit.cli.main import app

    run = tmp_path / "r"
    ck = run / "checkpoints" / "step-000000"
    ck.mkdir(parents=True)
    marker = tmp_path / "RAN"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(ck / "trainer_state.pt", "wb") as fh:
        pickle.dump({"next_step": 1, "optimizer": None, "rng": Evil(), "config": {}}, fh)
    res = CliRunner().invoke(app, ["train", "--model", "tiny-random", "--out", str(run), "--resume", "--steps", "2"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "trainer_state.pt: refused" in res.output and "could run code" in res.output
    assert not marker.exists() and sorted(p.name for p in run.iterdir()) == ["checkpoints"]


CLI_STOP = r"""
import os, signal, sys
from icsd_audit.dumps import writer as w
write = w.DumpWriter.write
def patched(self, **kw):
    path = write(self, **kw)
    if kw.get("name") == "step000001-mb000.parquet":
        os.kill(os.getpid(), signal.SIGTERM)
    return path
w.DumpWriter.write = patched
sys.argv = ["icsd", *sys.argv[1:]]
from icsd_audit.cli.main import main
main()
"""


def test_icsd_train_exits_143_with_one_line_naming_the_resume_command(tmp_path: Path, bank: str) -> None:  # noqa: F811
    run = tmp_path / "r"
    args = ["train", "--model", "tiny-random", "--steps", "2", "--out", str(run), "--plain", "--set", f"skillbank={bank}",
            "--set", "checkpoint_every=1", "--set", "max_response_tokens=8", "--set", "max_turns=1"]
    proc = subprocess.run([sys.executable, "-c", CLI_STOP, *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 143, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    want = "icsd " + shlex.join(args + ["--resume"])
    assert last.startswith("stopped by SIGTERM during step 1; steps 0..0 are complete")
    assert f"continue with: {want} (from checkpoints/step-000000)" in last
    assert _steps(run) == [0] and sorted(p.name for p in (run / "dumps").iterdir()) == ["step000000"]


SYNTH_STOP = r"""
import os, signal, sys
from icsd_audit.dumps import writer as w
write = w.DumpWriter.write
def patched(self, **kw):
    path = write(self, **kw)
    os.kill(os.getpid(), signal.SIGINT)
    return path
w.DumpWriter.write = patched
sys.argv = ["icsd", *sys.argv[1:]]
from icsd_audit.cli.main import main
main()
"""


def test_synth_is_all_or_nothing(tmp_path: Path) -> None:
    out = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-c", SYNTH_STOP, "synth", str(out), "--tokens", "3000", "--batches", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == f"stopped by SIGINT: nothing was written ({out} not created)"
    assert list(tmp_path.iterdir()) == []  # no OUT, no staging folder
    from typer.testing import CliRunner

    from icsd_audit.cli.main import app

    res = CliRunner().invoke(app, ["synth", str(out), "--tokens", "3000", "--batches", "3"])
    assert res.exit_code == 0 and len(list(out.glob("*.parquet"))) == 3
    again = CliRunner().invoke(app, ["synth", str(out), "--tokens", "3000", "--batches", "3"])
    assert again.exit_code == 2 and "choose a new or empty directory" in again.output


def test_eval_out_problems_are_reported_before_the_evaluation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from icsd_audit.cli.main import app
    from icsd_audit.train import eval as evaluation
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    monkeypatch.setattr(evaluation, "evaluate", lambda **kw: pytest.fail("evaluated before checking --out"))
    model = tmp_path / "M"
    m, tok = tiny_random_causal_lm(seed=0)
    m.save_pretrained(str(model))
    tok.save_pretrained(str(model))
    before = _files(model)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    (tmp_path / "d").mkdir()
    cases = {str(model / "config.json"): "--out lies inside the input model folder",
             str(model): "--out is the input model folder",
             str(tmp_path): "--out holds the input model folder",
             str(blocker.parent / "d"): "--out is a directory",
             str(blocker / "e.json"): "cannot be created: " + str(blocker) + " is not a directory"}
    for out, want in cases.items():
        res = CliRunner().invoke(app, ["eval", "--model", str(model), "--out", out, "--tasks", "1"])
        assert res.exit_code == 2 and want in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert _files(model) == before
