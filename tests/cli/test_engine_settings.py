"""Every allocator setting reaches every engine: the verl command, TRL's trainer, the built-in loop, config.json
and the dumps' provenance; and --dry-run checks the batch sizes against --gpus."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from icsd_audit.alloc.settings import AllocatorSettings
from icsd_audit.dumps.provenance import COEFFICIENT_KEYS
from icsd_audit.integrations.core import AllocationSettings
from icsd_audit.integrations.engines import EngineUnavailable, check_verl_batches, verl_overrides
from icsd_audit.train.config import TrainConfig

#: a non-default value for every allocator setting, under the run config's name (worked out by hand, not read
#: from the code under test: each differs from TrainConfig's default)
NON_DEFAULT = {"allocator": "permuted", "trust": "sigmoid", "trust_beta": 3.0, "trust_eta": 0.3, "influence_eta": 0.6,
               "min_group": 4, "alloc_eps": 0.001, "alloc_seed": 7}
#: the same under SPEC 9's names (what the dumps' allocator block and the +icsd overrides say)
EXPECTED = {"allocator": "permuted", "trust": "sigmoid", "trust_beta": 3.0, "trust_eta": 0.3, "influence_eta": 0.6,
            "min_group": 4, "eps": 0.001, "seed": 7}


def _icsd(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _flags() -> list[str]:
    """The settings as a user gives them: the two that have flags as flags, the rest with --set."""
    out = ["--allocator", NON_DEFAULT["allocator"], "--trust", NON_DEFAULT["trust"]]
    for k, v in NON_DEFAULT.items():
        if k not in ("allocator", "trust"):
            out += ["--set", f"{k}={v}"]
    return out


def test_one_list_of_allocator_settings_everywhere():
    # the list a setting is added to is the list every engine writes (and the audit reads back)
    assert set(f.name for f in dataclasses.fields(AllocatorSettings)) == set(COEFFICIENT_KEYS)
    assert {f.name for f in dataclasses.fields(AllocationSettings)} == {"distill_coef", *COEFFICIENT_KEYS}
    run_names = set(TrainConfig.ALLOCATION_FIELDS)
    assert run_names == set(NON_DEFAULT) and set(TrainConfig.ALLOCATION_FIELDS.values()) == set(COEFFICIENT_KEYS)
    defaults = TrainConfig()
    assert all(getattr(defaults, k) != v for k, v in NON_DEFAULT.items())  # each value really is non-default
    assert TrainConfig(**NON_DEFAULT).allocation().to_dict() == EXPECTED


@pytest.mark.parametrize("field", sorted(NON_DEFAULT))
def test_verl_command_carries_each_setting(tmp_path, field):
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), **{field: NON_DEFAULT[field]})
    icsd = {o.split("=", 1)[0][len("+icsd."):]: o.split("=", 1)[1] for o in verl_overrides(cfg) if o.startswith("+icsd.")}
    key = {"alloc_eps": "eps", "alloc_seed": "seed"}.get(field, field)
    assert icsd[key] == str(NON_DEFAULT[field])
    assert set(COEFFICIENT_KEYS) | {"distill_coef"} <= set(icsd)  # every other setting too, at its default


def _command_overrides(path: Path) -> list[str]:
    words = shlex.split(path.read_text().split("python -m verl.trainer.main_ppo", 1)[1].replace("\\\n", " "))
    return words


def test_verl_dry_run_writes_every_setting_into_the_command_and_config_json(tmp_path):
    run = tmp_path / "run"
    r = _icsd("train", "--engine", "verl", "--dry-run", "--model", "tiny-random", "--out", str(run),
              "--set", "distill_coef=0.02", *_flags())
    assert r.returncode == 0, r.stderr
    ovr = _command_overrides(run / "verl_command.sh")
    icsd = {o.split("=", 1)[0][len("+icsd."):]: o.split("=", 1)[1] for o in ovr if o.startswith("+icsd.")}
    assert {k: icsd[k] for k in EXPECTED} == {k: str(v) for k, v in EXPECTED.items()}
    assert icsd["distill_coef"] == "0.02"
    config = json.loads((run / "config.json").read_text())
    assert {k: config[k] for k in NON_DEFAULT} == NON_DEFAULT and config["distill_coef"] == 0.02


@pytest.mark.engines
def test_the_written_verl_command_configures_icsd_sync_with_every_setting(tmp_path):
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    import os

    import verl
    from hydra import compose, initialize_config_dir

    from icsd_audit.integrations.verl.trainer import ICSDVerlConfig

    cfg = TrainConfig(out_dir=str(tmp_path / "run"), model="/models/qwen", distill_coef=0.02, **NON_DEFAULT)
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"),
                               version_base=None):
        c = compose(config_name="ppo_trainer", overrides=verl_overrides(cfg))
    icsd = ICSDVerlConfig.from_config(c.icsd)
    assert icsd.allocator_settings().to_dict() == EXPECTED and icsd.distill_coef == 0.02
    assert icsd.micro_scope().settings().to_dict() == EXPECTED  # the micro-batch scope allocates with them too


def _dump_settings(dumps: Path) -> dict:
    from icsd_audit.dumps.reader import read_metadata

    shards = sorted(dumps.rglob("*.parquet"))
    assert shards
    blocks = [read_metadata(p)["allocator"] for p in shards]
    assert all(b == blocks[0] for b in blocks)
    return blocks[0]


def test_builtin_engine_dumps_record_every_setting(tmp_path):
    run = tmp_path / "run"
    r = _icsd("train", "--preset", "cpu-demo", "--model", "tiny-random", "--adv", "grpo", "--steps", "1",
              "--out", str(run), "--set", "n_tasks=2", "--set", "group_size=2", "--set", "max_turns=2",
              "--set", "max_response_tokens=6", "--set", "sketch_k=0", "--set", "distill_coef=0.02", *_flags())
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((run / "config.json").read_text())
    assert {k: config[k] for k in NON_DEFAULT} == NON_DEFAULT
    block = _dump_settings(run / "dumps")
    assert {k: block[k] for k in EXPECTED} == EXPECTED and block["lambda"] == 0.02


@pytest.mark.engines
def test_trl_engine_builds_its_trainer_and_dumps_with_every_setting(tmp_path):
    pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")
    run = tmp_path / "run"
    r = _icsd("train", "--engine", "trl", "--preset", "cpu-demo", "--model", "tiny-random", "--adv", "grpo",
              "--steps", "1", "--out", str(run), "--set", "n_tasks=2", "--set", "group_size=2",
              "--set", "max_turns=2", "--set", "max_response_tokens=6", "--set", "max_prompt_tokens=3000",
              "--set", "one_shot=false", "--set", "distill_coef=0.02", *_flags())
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((run / "config.json").read_text())
    assert {k: config[k] for k in NON_DEFAULT} == NON_DEFAULT
    block = _dump_settings(run / "dumps")
    assert {k: block[k] for k in EXPECTED} == EXPECTED and block["lambda"] == 0.02


def test_trl_engine_builds_icsdconfig_from_the_one_list():
    pytest.importorskip("trl", reason="TRL not installed")
    from icsd_audit.integrations.trl import trainer as trl
    cfg = TrainConfig(distill_coef=0.02, **NON_DEFAULT)
    icsd = trl.ICSDConfig.from_run(cfg, dump_dir="d")
    assert icsd.allocator_settings().to_dict() == EXPECTED and (icsd.distill_coef, icsd.dump_dir) == (0.02, "d")


def test_trl_engine_refuses_micro_batch_scope_in_one_line(tmp_path):
    pytest.importorskip("trl", reason="TRL not installed")
    r = _icsd("train", "--engine", "trl", "--preset", "cpu-demo", "--model", "tiny-random", "--adv", "grpo",
              "--out", str(tmp_path / "run"), "--set", "alloc_scope=micro-batch")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: icsd train --engine trl allocates once per generation batch (one optimizer step), not "
        "alloc_scope='micro-batch': drop it, or use --engine builtin or verl"]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ batch sizes against --gpus


@pytest.mark.parametrize("n_tasks,group,mini_rows,gpus,ok", [
    (2, 3, 64, 4, False),  # the CLI default: 6 rows over 4 GPUs
    (2, 3, 64, 2, True), (2, 3, 64, 3, True), (2, 3, 64, 6, True), (2, 3, 64, 1, True),
    (16, 8, 512, 4, True), (16, 8, 512, 3, False),
    (4, 2, 2, 2, True),    # mini-batch: 1 prompt x 2 rows over 2 GPUs
    (4, 2, 2, 4, False),   # a step's 8 rows split, but a mini-batch's 2 rows cannot
    (3, 2, 2, 4, False),   # neither: both options
])
def test_batch_sizes_against_gpus(n_tasks, group, mini_rows, gpus, ok):
    cfg = TrainConfig(n_tasks=n_tasks, group_size=group, mini_batch_rows=mini_rows)
    if ok:
        check_verl_batches(cfg, n_gpus=gpus)
        return
    with pytest.raises(EngineUnavailable) as e:
        check_verl_batches(cfg, n_gpus=gpus)
    msg = str(e.value)
    assert msg.startswith(f"--gpus {gpus}: verl splits ") and "\n" not in msg
    fix = {k: int(v.split()[0]) for k, v in (x.split("=", 1) for x in msg.split("--set ")[1:])}
    check_verl_batches(cfg.replace(**fix), n_gpus=gpus)  # the suggested fix passes
    if "n_tasks" in fix:  # and takes the fewest tasks that do
        assert all(not _fits(cfg.replace(**{**fix, "n_tasks": n}), gpus) for n in range(n_tasks, fix["n_tasks"]))
    for g in msg.split(", or --gpus ")[1].replace(" or ", ", ").split(", "):
        check_verl_batches(cfg, n_gpus=int(g))  # every GPU count offered fits


def _fits(cfg: TrainConfig, gpus: int) -> bool:
    try:
        check_verl_batches(cfg, n_gpus=gpus)
        return True
    except EngineUnavailable:
        return False


def test_dry_run_with_too_many_gpus_stops_before_writing(tmp_path):
    r = _icsd("train", "--engine", "verl", "--dry-run", "--gpus", "4", "--out", str(tmp_path / "run"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: --gpus 4: verl splits a step's 6 rows (n_tasks 2 x group_size 3) evenly over 4 GPU(s); "
        "fix: --set n_tasks=4 (12 rows), or --gpus 1, 2, 3 or 6"]
    assert not (tmp_path / "run").exists()


@pytest.mark.engines
@pytest.mark.parametrize("gpus,ok", [(4, False), (3, True), (2, True)])
def test_batch_check_agrees_with_verls_validate_config(tmp_path, gpus, ok):
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from icsd_audit.train.config.presets import preset

    cfg = preset("cpu-demo").replace(out_dir=str(tmp_path / "run"), model="/models/qwen")
    assert (cfg.n_tasks, cfg.group_size) == (2, 3)
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"),
                               version_base=None):
        c = compose(config_name="ppo_trainer", overrides=verl_overrides(cfg, n_gpus=gpus))
    assert _fits(cfg, gpus) is ok
    if ok:
        validate_config(c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
    else:
        with pytest.raises((AssertionError, ValueError), match="divisible"):
            validate_config(c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))


# ------------------------------------------------------------------ the verl commands of docs/engines.md

DOCS = Path(__file__).resolve().parents[2] / "docs" / "engines.md"


def _doc_commands() -> list[list[str]]:
    """The overrides of every ``python -m verl.trainer.main_ppo`` in docs/engines.md's bash blocks."""
    blocks = DOCS.read_text().split("```bash\n")[1:]
    out = []
    for block in (b.split("```", 1)[0] for b in blocks):
        for cmd in block.replace("\\\n", " ").splitlines():
            if "verl.trainer.main_ppo" in cmd:
                out.append(shlex.split(cmd.split("verl.trainer.main_ppo", 1)[1]))
    return out


def test_the_docs_verl_commands_are_complete():
    cmds = _doc_commands()
    assert len(cmds) == 2  # the distillation run and the command icsd train --engine verl writes
    assert not any("..." in w for c in cmds for w in c)
    for c in cmds:
        assert "trainer.use_v1=true" in c


def test_the_docs_full_command_is_what_icsd_train_writes():
    from icsd_audit.train.config.presets import preset

    full = next(c for c in _doc_commands() if "trainer.v1.trainer_mode=icsd_sync" in c)
    cfg = preset("paper").replace(model="/models/Qwen2.5-1.5B-Instruct", out_dir="runs/verl-webshop")
    assert full == verl_overrides(cfg, n_gpus=4)


@pytest.mark.engines
@pytest.mark.parametrize("index", [0, 1])
def test_the_docs_verl_commands_pass_verls_config_checks(index):
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from icsd_audit.integrations.verl.distill import LOSS_ALLOCATORS
    from icsd_audit.integrations.verl.trainer import ICSDVerlConfig

    ovr = _doc_commands()[index]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"),
                               version_base=None):
        c = compose(config_name="ppo_trainer", overrides=ovr)
    validate_config(c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
    assert c.trainer.use_v1 is True
    if c.trainer.v1.trainer_mode == "icsd_sync":
        ICSDVerlConfig.from_config(c.icsd)  # every +icsd option is one the trainer knows
    if c.distillation.enabled:
        assert c.distillation.distillation_loss.loss_mode in LOSS_ALLOCATORS
        omega_conf_to_dataclass(c.distillation)  # verl's DistillationConfig checks (teacher pool, its replicas)
        # verl 0.9.1's trainer (v1 trainer_base) refuses a teacher pool of no GPU when it builds its resource pools
        assert c.distillation.nnodes > 0 and c.distillation.n_gpus_per_node > 0
