"""The verl plug-in registers lazily (``import verl`` pays for the standard library only) and checks the ICSD_*
variables the registry losses read when it registers them, naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from icsd_audit.integrations.verl.loss import scope_from_env

def _fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "auto", "PYTHONWARNINGS": "default", **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300)


@pytest.mark.engines
def test_import_verl_loads_the_plugin_and_nothing_heavy():
    """What ``import verl`` imports with the plug-in beyond what it imports without: the plug-in's two modules, its
    packages and standard-library modules only (no torch-heavy or icsd-heavy import, no registration yet)."""
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    code = ("import sys, verl, json\nm = sys.modules.get('icsd_audit.integrations.verl.plugin')\n"
            "print(json.dumps([sorted(sys.modules), sorted(m.registered()) if m else None]))")
    import json

    (auto, done), (none, _) = (json.loads(_fresh(code, VERL_USE_EXTERNAL_PLUGINS=p).stdout.strip().splitlines()[-1])
                               for p in ("auto", "none"))
    extra = set(auto) - set(none)
    ours = {x for x in extra if x.startswith("icsd_audit")}
    # the package's own light modules (icsd_audit's __init__: its version and the moved-names finder; the verl
    # package's first-use exporter, icsd_audit.lazy, standard library only) and the plug-in's
    assert ours == {"icsd_audit", "icsd_audit.version", "icsd_audit.moved", "icsd_audit.lazy", "icsd_audit.integrations",
                    "icsd_audit.integrations.verl", "icsd_audit.integrations.verl.plugin",
                    "icsd_audit.integrations.verl.compat"}
    assert all(x.split(".")[0] in sys.stdlib_module_names for x in extra - ours), sorted(extra - ours)
    assert done == []


@pytest.mark.engines
def test_each_registry_gets_our_names_when_verl_loads_it():
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    r = _fresh("import sys, verl\nm = sys.modules['icsd_audit.integrations.verl.plugin']\n"
               "from verl.trainer.ppo.core_algos import get_adv_estimator_fn\n"
               "print(get_adv_estimator_fn('gigpo').__name__, 'verl.trainer.ppo.v1' in sys.modules)\n"
               "from verl.trainer.distillation.losses import get_distillation_loss_fn\n"
               "print(get_distillation_loss_fn('icsd_sign').__name__)\n"
               "from verl.trainer.ppo.v1 import get_trainer_cls\n"
               "print(get_trainer_cls('icsd_sync').__name__, sorted(m.registered()))\n"
               "from verl.trainer.ppo.v1.trainer_base import PPOTrainer\n"
               "from verl.trainer.ppo.ray_trainer import RayPPOTrainer\n"
               "print(PPOTrainer.init.__icsd_record__, RayPPOTrainer.init_workers.__icsd_record__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-4:] == [
        "compute_gigpo_advantage False", "icsd_distillation_loss",
        "ICSDTrainerSync ['verl.trainer.distillation.losses', 'verl.trainer.ppo.core_algos', "
        "'verl.trainer.ppo.ray_trainer', 'verl.trainer.ppo.v1', 'verl.trainer.ppo.v1.trainer_base']",
        "True True"]  # the +icsd.record switch on v1 (record.register_switch), the legacy refusal
    assert "cannot register" not in r.stderr


@pytest.mark.engines
def test_a_bad_icsd_variable_stops_the_registration_naming_it():
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    r = _fresh("import verl\nimport verl.trainer.distillation.losses", ICSD_TRUST="sigmod")
    assert r.returncode == 1
    line = "icsd verl plug-in: ICSD_TRUST='sigmod': unknown trust 'sigmod'; valid: laplace, sigmoid, uniform"
    assert r.stderr.strip().splitlines()[-1] == f"ValueError: {line}"
    assert "icsd verl plug-in cannot register: ICSD_TRUST='sigmod'" in r.stderr  # the ERROR log line too
    ok = _fresh("import verl\nimport verl.trainer.distillation.losses\nprint('ok')", ICSD_TRUST="sigmoid")
    assert ok.returncode == 0 and ok.stdout.strip().endswith("ok"), ok.stderr


@pytest.mark.parametrize("var,value,message", [
    ("ICSD_TRUST", "sigmod", "ICSD_TRUST='sigmod': unknown trust 'sigmod'; valid: laplace, sigmoid, uniform"),
    ("ICSD_TRUST_BETA", "0", "ICSD_TRUST_BETA='0': trust_beta must be a finite number > 0, got 0.0"),
    ("ICSD_TRUST_ETA", "1", "ICSD_TRUST_ETA='1': trust_eta must lie in (0, 1), got 1.0"),
    ("ICSD_INFLUENCE_ETA", "-0.5", "ICSD_INFLUENCE_ETA='-0.5': influence_eta must lie in (0, 1), got -0.5"),
    ("ICSD_MIN_GROUP", "0", "ICSD_MIN_GROUP='0': min_group must be an integer >= 1, got 0"),
    ("ICSD_EPS", "nan", "ICSD_EPS='nan': eps must be a finite number > 0, got nan"),
    ("ICSD_EPS", "x", "ICSD_EPS='x' is not a valid number"),
    ("ICSD_MIN_GROUP", "2.5", "ICSD_MIN_GROUP='2.5' is not a valid integer"),
])
def test_each_variable_is_checked_naming_it(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as e:
        scope_from_env("icsd", producer="test")
    assert str(e.value) == message


def test_the_variables_give_every_setting(monkeypatch):
    env = {"ICSD_TRUST": "sigmoid", "ICSD_TRUST_BETA": "3", "ICSD_TRUST_ETA": "0.3", "ICSD_INFLUENCE_ETA": "0.6",
           "ICSD_MIN_GROUP": "4", "ICSD_EPS": "1e-3", "ICSD_SEED": "7", "ICSD_DUMP_DIR": "/d"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    scope = scope_from_env("permuted", producer="test")
    assert scope.settings().to_dict() == {"allocator": "permuted", "trust": "sigmoid", "trust_beta": 3.0,
                                          "trust_eta": 0.3, "influence_eta": 0.6, "eps": 0.001, "min_group": 4,
                                          "seed": 7}
    assert scope.dump_dir == "/d"
