"""train.launch: the rules that tie a config to an engine, checked before anything is loaded or written."""

from __future__ import annotations

import pytest

from icsd_audit.train.config import from_preset
from icsd_audit.train.launch import ENGINES, check_launch


@pytest.mark.parametrize("engine, kw, change, message", [
    ("megatron", {}, {}, "--engine 'megatron': choose one of builtin, trl, verl"),
    ("builtin", {"dry_run": True}, {}, "--dry-run and --gpus are options of --engine verl, not --engine builtin"),
    ("trl", {"gpus": 2}, {}, "--dry-run and --gpus are options of --engine verl, not --engine trl"),
    ("verl", {"gpus": 0}, {}, "--gpus 0: must be >= 1"),
    ("trl", {}, {"policy": "expert"}, "--policy expert plays the built-in loop's rollouts; drop --engine trl"),
    ("verl", {}, {"hybrid": "rlsd", "allocator": "none"}, "--hybrid rlsd runs on the builtin engine only"),
])
def test_a_config_the_engine_cannot_run_is_one_line(engine: str, kw: dict, change: dict, message: str) -> None:
    cfg = from_preset("cpu-demo", model="tiny-random", **change)
    with pytest.raises(ValueError) as err:
        check_launch(cfg, engine=engine, **kw)
    assert message in str(err.value)


def test_every_engine_names_a_function_of_its_module() -> None:
    assert set(ENGINES) == {"builtin", "trl", "verl"}
    for target in ENGINES.values():
        module, _, function = target.partition(":")
        assert module.startswith("icsd_audit.") and function.isidentifier()
    check_launch(from_preset("cpu-demo", model="tiny-random"), engine="builtin")  # a config it can run passes
