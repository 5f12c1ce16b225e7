"""The audit recomputes what was deployed (SPEC 9): recorded settings by default, flags override in one line each."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from icsd_audit.dumps.provenance import SettingsMismatch
from icsd_audit.dumps.reader import DumpWarning
from icsd_audit.audit.settings import audit_settings
from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import DumpWriter
from tests.helpers import cli, one_line_exit_2
from tests.dumps.test_verify import SETTINGS, deploy

EPS = SETTINGS["eps"]


def tcm_of(paths: list[Path], column: str) -> float:
    """SPEC 6 TCM of a stored weighting, by hand: sum w over {delta>0, |u|>eps, u<0} / over {delta>0, |u|>eps}."""
    t = {k: np.concatenate([pq.read_table(p).column(k).to_numpy() for p in paths]).astype(np.float64)
         for k in ("advantage", "ratio", "delta", column)}
    u = t["advantage"] * t["ratio"] * t["delta"]
    act = (t["delta"] > 0) & (np.abs(u) > EPS)
    return float(t[column][act & (u < 0)].sum() / t[column][act].sum())


def test_tcm_without_flags_audits_the_deployed_c_and_sdars_trust(tmp_path: Path) -> None:
    shards = list(deploy(tmp_path / "d").values())
    r = cli("audit", "tcm", str(tmp_path / "d"), "--json", "--resamples", "50")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # nothing overridden, nothing unknown
    res = json.loads(r.stdout)
    # the compared side is the deployed c, the base SDAR's g with the deployed (sigmoid, beta 3) trust
    assert res["icsd"]["estimate"] == pytest.approx(tcm_of(shards, "c"), rel=1e-6)
    assert res["sdar"]["estimate"] == pytest.approx(tcm_of(shards, "g"), rel=1e-6)
    # the same numbers as naming every deployed setting
    explicit = cli("audit", "tcm", str(tmp_path / "d"), "--json", "--resamples", "50", "--trust", "sigmoid",
                   "--trust-beta", "3", "--min-group", "4", "--eps", "1e-3")
    assert json.loads(explicit.stdout) == res and explicit.stderr == ""
    # an override: other numbers, and one line naming what it replaces
    other = cli("audit", "tcm", str(tmp_path / "d"), "--json", "--resamples", "50", "--trust", "laplace")
    assert other.returncode == 0
    assert other.stderr.strip().splitlines() == [
        f"note: --trust laplace overrides the deployed trust 'sigmoid' (recorded in {shards[0]})"]
    assert json.loads(other.stdout)["icsd"]["estimate"] != res["icsd"]["estimate"]


def test_coeffs_without_flags_reproduces_the_deployed_c(tmp_path: Path) -> None:
    shards = list(deploy(tmp_path / "d").values())
    out = tmp_path / "c.parquet"
    r = cli("audit", "coeffs", str(tmp_path / "d"), "--out", str(out))
    assert r.returncode == 0, r.stderr
    got = pq.read_table(out)
    for k in ("g", "m", "c"):
        stored = np.concatenate([pq.read_table(p).column(k).to_numpy() for p in shards])
        assert np.array_equal(got.column(k).to_numpy().astype(np.float32), stored), k


def test_disagreeing_shards_are_refused_or_grouped_by_settings(tmp_path: Path) -> None:
    a = list(deploy(tmp_path / "d" / "a", batches=2).values())
    b = list(deploy(tmp_path / "d" / "b", settings=dict(SETTINGS, trust_beta=7.0), batches=2, seed=3,
                    first_batch=10).values())
    r = cli("audit", "quadrants", str(tmp_path / "d"), "--json", "--resamples", "20")
    line = one_line_exit_2(r, "'trust_beta'", "7.0", "3.0")
    assert str(a[0]) in line and str(b[0]) in line
    # the differing setting given as a flag: pooled, each replaced recorded value named once
    r = cli("audit", "quadrants", str(tmp_path / "d"), "--json", "--resamples", "20", "--trust-beta", "5")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"note: --trust-beta 5 overrides the deployed trust_beta 3 (recorded in {a[0]})",
        f"note: --trust-beta 5 overrides the deployed trust_beta 7 (recorded in {b[0]})"]
    # --by settings: each group with its own settings, as if audited alone
    g = cli("audit", "tcm", str(tmp_path / "d"), "--json", "--resamples", "20", "--by", "settings")
    assert g.returncode == 0, g.stderr
    groups = json.loads(g.stdout)["groups"]
    assert [x["key"] for x in groups] == ["icsd trust=sigmoid trust_beta=3 influence_eta=0.5 eps=0.001 min_group=4",
                                         "icsd trust=sigmoid trust_beta=7 influence_eta=0.5 eps=0.001 min_group=4"]
    assert groups[1]["files"] == [str(p) for p in b]
    alone = json.loads(cli("audit", "tcm", str(tmp_path / "d" / "b"), "--json", "--resamples", "20").stdout)
    assert groups[1]["icsd"]["estimate"] == alone["icsd"]["estimate"] == pytest.approx(tcm_of(b, "c"), rel=1e-6)


def test_dumps_without_settings_keep_the_defaults_with_one_warning(tmp_path: Path) -> None:
    cols = synth_tokens(2000, seed=5, n_batches=2)
    DumpWriter(tmp_path / "d", producer={"name": "foreign"}).write(**cols)
    with_defaults = cli("audit", "tcm", str(tmp_path / "d"), "--json", "--resamples", "20")
    assert with_defaults.returncode == 0
    (warn,) = with_defaults.stderr.strip().splitlines()
    assert warn.startswith("warning: ") and "no deployed allocator settings recorded" in warn
    assert "allocator='icsd', trust='laplace'" in warn
    named = cli("audit", "tcm", str(tmp_path / "d"), "--json", "--resamples", "20", "--trust", "laplace",
                "--min-group", "8", "--eps", "1e-4")
    assert json.loads(named.stdout) == json.loads(with_defaults.stdout)


def test_library_settings_and_a_deployed_sdar_is_the_base(tmp_path: Path) -> None:
    deploy(tmp_path / "s", settings=dict(SETTINGS, allocator="sdar"))
    s = audit_settings([tmp_path / "s"])
    assert s.deployed.allocator == "sdar" and s.deployed.trust == "sigmoid" and s.deployed.trust_beta == 3.0
    base, compare = s.pair()
    assert (base.allocator, compare.allocator) == ("sdar", "icsd") and compare.trust == "sigmoid"
    assert s.pair(compare="fisher")[1].allocator == "fisher"
    deploy(tmp_path / "i")
    with pytest.raises(SettingsMismatch, match="'allocator'"):
        audit_settings([tmp_path / "s", tmp_path / "i"])
    o = audit_settings([tmp_path / "s", tmp_path / "i"], allocator="icsd")
    assert len(o.overrides) == 1 and "--allocator icsd overrides the deployed allocator 'sdar'" in o.overrides[0]
    # a partly recorded block: the relevant settings it leaves null are SPEC's defaults, with one warning
    DumpWriter(tmp_path / "p", producer="x", allocation={"allocator": "icsd"}).write(**synth_tokens(300, n_batches=1))
    with pytest.warns(DumpWarning, match="do not record trust, trust_eta, influence_eta, eps, min_group"):
        assert audit_settings([tmp_path / "p"]).deployed.eps == 1e-4


def test_library_functions_audit_what_was_deployed(tmp_path: Path) -> None:
    from icsd_audit.audit.coeffs import compute_coefficients
    from icsd_audit.report.build import audit_dumps
    from icsd_audit.audit.run import run_audit

    shards = list(deploy(tmp_path / "d").values())
    res = run_audit([tmp_path / "d"], statistics=("tcm",))
    assert res.tcm.compare.estimate == pytest.approx(tcm_of(shards, "c"), rel=1e-6)
    rep = audit_dumps([tmp_path / "d"])
    assert rep.options.trust == "sigmoid" and rep.options.trust_beta == 3.0 and rep.options.min_group == 4
    assert rep.stats.tcm.compare.estimate == pytest.approx(tcm_of(shards, "c"), rel=1e-6)
    compute_coefficients([tmp_path / "d"], tmp_path / "c.parquet")
    c = pq.read_table(tmp_path / "c.parquet").column("c").to_numpy()
    assert np.array_equal(c.astype(np.float32), np.concatenate([pq.read_table(p).column("c").to_numpy()
                                                                 for p in shards]))


def test_a_resumed_folder_is_audited_with_the_settings_of_the_shards_that_count(tmp_path: Path) -> None:
    from icsd_audit.audit.verify import verify_dumps

    deploy(tmp_path / "d", settings=dict(SETTINGS, trust_beta=7.0), batches=2)  # a first launch
    later = deploy(tmp_path / "d", batches=2)  # a restart writes both batches again, with beta 3
    with pytest.warns(DumpWarning, match="written again later"):
        s = audit_settings([tmp_path / "d"])
    assert s.deployed.trust_beta == 3.0 and s.recorded is not None and s.recorded.files == tuple(later.values())
    with pytest.warns(DumpWarning, match="written again later"):
        assert verify_dumps([tmp_path / "d"]).ok


def test_a_foreign_block_with_a_bad_setting_is_one_line(tmp_path: Path) -> None:
    import pyarrow as pa

    cols = synth_tokens(300, seed=1, n_batches=1)
    blob = {"schema": "icsd.token_dump", "version": 1, "producer": {"name": "foreign"}, "synthetic": False,
            "allocator": {"allocator": "icsd", "eps": float("nan"), "min_group": "eight"}}
    table = pa.table(cols).replace_schema_metadata({b"icsd.dump": json.dumps(blob).encode()})  # NaN as foreign JSON
    pq.write_table(table, tmp_path / "f.parquet")
    for cmd in (("tcm", "--json"), ("verify",)):
        r = cli("audit", *cmd, str(tmp_path / "f.parquet"))
        one_line_exit_2(r, "f.parquet", "recorded allocator setting 'eps' is nan")
