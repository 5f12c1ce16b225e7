"""AllocatorSettings: one object, validated once, defaults written once, shared help text."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from icsd_audit.alloc.registry import allocator_names, register_trust, trust_names
from icsd_audit.alloc.settings import DEFAULTS, SETTING_HELP, SETTING_NAMES, AllocatorSettings
from icsd_audit.alloc.variants import allocate
from icsd_audit.dumps.provenance import COEFFICIENT_KEYS, deployed_block

ROOT = Path(__file__).resolve().parents[2]


def test_the_settings_are_spec_9s_keys_with_spec_defaults() -> None:
    assert SETTING_NAMES == COEFFICIENT_KEYS
    assert DEFAULTS.to_dict() == {"allocator": "icsd", "trust": "laplace", "trust_beta": 5.0, "trust_eta": 0.4,
                                  "influence_eta": 0.5, "eps": 1e-4, "min_group": 8, "seed": 0}
    assert set(SETTING_HELP) == set(SETTING_NAMES) and all(SETTING_HELP.values())


def test_the_default_names_are_registered() -> None:
    # the settings skip the registry (and torch) for their own default names: they must be registered
    assert DEFAULTS.allocator in allocator_names() and DEFAULTS.trust in trust_names()


@pytest.mark.parametrize("change, message", [
    ({"allocator": "icsdd"}, "unknown allocator 'icsdd'; valid: fisher, gaussian, icsd"),
    ({"trust": "sigmod"}, "unknown trust 'sigmod'; valid: laplace, sigmoid, uniform"),
    ({"trust_beta": float("nan")}, "trust_beta must be a finite number > 0"),
    ({"trust_beta": 0.0}, "trust_beta must be a finite number > 0"),
    ({"eps": -1e-4}, "eps must be a finite number > 0"),
    ({"trust_eta": 1.0}, "trust_eta must lie in (0, 1)"),
    ({"influence_eta": 0}, "influence_eta must lie in (0, 1)"),
    ({"min_group": 0}, "min_group must be an integer >= 1"),
    ({"min_group": 2.5}, "min_group must be an integer >= 1"),
    ({"seed": -1}, "seed must be an integer in [0, 2**63)"),
    ({"trust_beta": True}, "trust_beta must be a finite number > 0"),
])
def test_bad_settings_are_refused_on_construction(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        AllocatorSettings(**change)
    assert message in str(err.value)


def test_every_problem_is_listed_at_once() -> None:
    with pytest.raises(ValueError) as err:
        AllocatorSettings(trust_beta=-1, eps=0, min_group=0)
    assert str(err.value).count(";") == 2


def test_replace_leaves_none_alone_and_refuses_unknown_names() -> None:
    s = DEFAULTS.replace(trust="sigmoid", trust_beta=None)
    assert s.trust == "sigmoid" and s.trust_beta == DEFAULTS.trust_beta
    assert DEFAULTS.replace() is DEFAULTS
    with pytest.raises(TypeError, match="unknown allocator setting"):
        DEFAULTS.replace(beta=3.0)


def test_allocate_takes_the_object_and_keywords_override_one_setting() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 64
    kw = dict(advantage=torch.randn(n, generator=gen, dtype=torch.float64),
              ratio=torch.ones(n, dtype=torch.float64), delta=torch.randn(n, generator=gen, dtype=torch.float64),
              traj_id=torch.arange(n) // 8, turn_id=torch.zeros(n, dtype=torch.long))
    s = AllocatorSettings(trust="sigmoid", trust_beta=3.0)
    a = allocate(settings=s, **kw)
    assert torch.equal(a.g, torch.sigmoid(3.0 * kw["delta"]))
    b = allocate(settings=s, trust_beta=2.0, **kw)  # one keyword replaces one setting
    assert torch.equal(b.g, torch.sigmoid(2.0 * kw["delta"]))
    assert torch.equal(allocate(**kw).c, allocate(settings=DEFAULTS, **kw).c)


def test_the_provenance_block_is_the_objects_serialisation() -> None:
    s = AllocatorSettings(allocator="sdar", trust="sigmoid", trust_beta=3.0, trust_eta=0.3, influence_eta=0.6,
                          eps=1e-3, min_group=4, seed=7)
    block = deployed_block(s, alloc_scope="mini-batch", ratio_source="prepass")
    assert {k: block[k] for k in SETTING_NAMES} == s.to_dict()
    assert deployed_block({"trust": "sigmoid"}, alloc_scope=None, ratio_source=None)["trust_beta"] == 5.0


def test_a_duplicate_trust_is_refused() -> None:
    with pytest.raises(ValueError, match="trust 'laplace' is already registered"):
        register_trust("laplace")(lambda *a, **k: None)


def test_importing_the_settings_imports_no_torch() -> None:
    code = ("import sys; from icsd_audit.alloc.settings import DEFAULTS, AllocatorSettings; "
            "AllocatorSettings(trust_beta=3.0); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# literal defaults of the allocator settings, as they would be written in a signature or a field
_DEFAULT_LITERALS = {"trust_beta": 5.0, "trust_eta": 0.4, "influence_eta": 0.5, "eps": 1e-4, "alloc_eps": 1e-4,
                     "min_group": 8}


def _literal_defaults(path: Path) -> list[str]:
    """``name = <the default literal>`` as a parameter default, dataclass field or keyword default."""
    out = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        pairs: list[tuple[str, ast.AST | None]] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            pos = args.posonlyargs + args.args
            pairs += list(zip([a.arg for a in pos[len(pos) - len(args.defaults):]], args.defaults))
            pairs += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            pairs.append((node.target.id, node.value))
        for name, value in pairs:
            if (name in _DEFAULT_LITERALS and isinstance(value, ast.Constant)
                    and value.value == _DEFAULT_LITERALS[name] and not isinstance(value.value, bool)):
                out.append(f"{path.relative_to(ROOT)}:{value.lineno} {name} = {value.value!r}")
    return out


def test_each_allocator_default_is_written_once() -> None:
    found = [hit for base in ("icsd_audit", "cli") for p in sorted((ROOT / base).rglob("*.py"))
             for hit in _literal_defaults(p)]
    assert len(found) == 5 and all(h.startswith("icsd_audit/alloc/settings.py:") for h in found), found
    # the sanity of the finder itself: it sees settings.py's own five
    assert {re.sub(r":\d+", "", h) for h in found} == {
        "icsd_audit/alloc/settings.py trust_beta = 5.0", "icsd_audit/alloc/settings.py trust_eta = 0.4",
        "icsd_audit/alloc/settings.py influence_eta = 0.5", "icsd_audit/alloc/settings.py eps = 0.0001",
        "icsd_audit/alloc/settings.py min_group = 8"}
