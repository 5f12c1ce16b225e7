"""``icsd audit verify``: each batch recomputed with its recorded settings against the stored g, m, c."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from icsd_audit.alloc.variants import allocate
from icsd_audit.dumps.provenance import deployed_block
from icsd_audit.dumps.reader import DumpError
from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.audit.verify import verify_dumps
from icsd_audit.dumps.writer import DumpWriter

#: deployed with settings no audit default matches
SETTINGS = dict(allocator="icsd", trust="sigmoid", trust_beta=3.0, min_group=4, eps=1e-3)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True, timeout=300)


def deploy(out: Path, *, settings: dict = SETTINGS, recorded: dict | None = None, n: int = 3000, batches: int = 4,
           seed: int = 0, first_batch: int = 0) -> dict[int, Path]:
    """A producer: allocate each batch of float32 inputs in float64 with ``settings``, store float32 g, m, c and
    record ``recorded`` (default: the settings deployed); one shard per batch, ids from ``first_batch``."""
    cols = synth_tokens(n, seed=seed, n_batches=batches)
    cols["batch_id"] = cols["batch_id"] + first_batch
    w = DumpWriter(out, producer={"name": "test-producer", "engine": "user"},
                   allocation=deployed_block(recorded or settings, alloc_scope="mini-batch", ratio_source="prepass"))
    shards = {}
    for b in np.unique(cols["batch_id"]):
        sel = cols["batch_id"] == b
        part = {k: v[sel] for k, v in cols.items()}
        a = allocate(**{k: torch.from_numpy(part[k]).double() for k in ("advantage", "ratio", "delta")},
                     traj_id=torch.from_numpy(part["traj_id"]),
                     turn_id=torch.from_numpy(part["turn_id"].astype(np.int64)), **settings)
        shards[int(b)] = w.write(**part, g=a.g.float().numpy(), m=a.m.float().numpy(), c=a.c.float().numpy())
    return shards


def alter(path: Path, column: str, row: int, value: float) -> None:
    """Rewrite one stored value in place of the shard (keeping its metadata)."""
    t = pq.read_table(path)
    v = t.column(column).to_numpy().copy()
    v[row] = value
    t = t.set_column(t.column_names.index(column), column, pa.array(v))
    pq.write_table(t, path)


def test_a_faithful_dump_agrees_batch_by_batch(tmp_path: Path) -> None:
    shards = deploy(tmp_path / "d")
    res = verify_dumps([tmp_path / "d"])
    assert res.ok and [b.batch_id for b in res.batches] == sorted(shards)
    assert res.checked == ("g", "m", "c") and res.n_tokens == 3000
    # float64 recomputed from the same float32 inputs, stored float32: within half a float32 ulp
    assert max(b.max_rel for b in res.batches) <= 2.0 ** -24
    assert res.settings[0]["trust"] == "sigmoid" and res.settings[0]["trust_beta"] == 3.0


def test_one_altered_c_is_found_and_named(tmp_path: Path) -> None:
    shards = deploy(tmp_path / "d")
    target = shards[2]
    c = pq.read_table(target).column("c").to_numpy()
    alter(target, "c", 17, c[17] + 0.25)
    res = verify_dumps([tmp_path / "d"])
    assert not res.ok
    (bad,) = res.differing
    assert bad.batch_id == 2 and bad.file == str(target)
    cols = {x.name: x for x in bad.columns}
    assert cols["c"].n_differ == 1 and cols["g"].n_differ == 0 and cols["m"].n_differ == 0
    assert cols["c"].max_abs == pytest.approx(0.25, abs=1e-6)
    assert cols["c"].max_rel == pytest.approx(0.25 / c[17], rel=1e-5)
    # the command: exit 1, one line for the batch, then the summary
    r = cli("audit", "verify", str(tmp_path / "d"))
    assert r.returncode == 1, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"batch 2 ({target}): c differs on 1 of ")
    assert "max abs error 2.500e-01" in lines[0] and "g, m agree" in lines[0]
    assert "1 of 4 batches differ" in lines[1]
    j = cli("audit", "verify", str(tmp_path / "d"), "--json")
    assert j.returncode == 1
    payload = json.loads(j.stdout)
    assert payload["ok"] is False and payload["n_differing"] == 1 and payload["n_batches"] == 4
    assert [b["batch_id"] for b in payload["batches"] if not b["ok"]] == [2]


def test_three_ulps_off_differs_and_exact_storage_agrees(tmp_path: Path) -> None:
    shards = deploy(tmp_path / "d", n=800, batches=1)
    (path,) = shards.values()
    g = pq.read_table(path).column("g").to_numpy()
    i = int(np.argmax(g > 0.1))
    alter(path, "g", i, np.nextafter(np.nextafter(np.nextafter(g[i], np.float32(2)), np.float32(2)), np.float32(2)))
    res = verify_dumps([path])
    assert {c.name: c.n_differ for c in res.batches[0].columns}["g"] == 1


def test_settings_recorded_wrong_make_every_batch_differ(tmp_path: Path) -> None:
    deploy(tmp_path / "d", recorded=dict(SETTINGS, trust="laplace"))
    res = verify_dumps([tmp_path / "d"])
    assert len(res.differing) == len(res.batches) == 4


def test_exit_codes_and_one_line_errors(tmp_path: Path) -> None:
    deploy(tmp_path / "ok")
    r = cli("audit", "verify", str(tmp_path / "ok"))
    assert r.returncode == 0 and "every batch agrees within float32 storage tolerance" in r.stdout
    # no recorded settings: bad input, one line naming the file
    cols = synth_tokens(200, seed=1, n_batches=1)
    DumpWriter(tmp_path / "bare", producer="x").write(**cols, c=np.ones(200, np.float32))
    r = cli("audit", "verify", str(tmp_path / "bare"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "records no allocator settings" in r.stderr and "bare" in r.stderr
    # settings, but nothing deployed to compare with
    DumpWriter(tmp_path / "noc", producer="x", allocation=deployed_block(
        {}, alloc_scope=None, ratio_source=None)).write(**cols)
    r = cli("audit", "verify", str(tmp_path / "noc"))
    assert r.returncode == 2 and "none of the deployed columns g, m, c" in r.stderr
    with pytest.raises(DumpError, match="none of the deployed columns"):
        verify_dumps([tmp_path / "noc"])


def test_a_batch_over_files_with_different_settings_is_bad_input(tmp_path: Path) -> None:
    cols = synth_tokens(400, seed=2, n_batches=1)
    half = np.arange(400) < 200  # rows of one batch, split over two files
    w = DumpWriter(tmp_path / "d", producer="x")  # one writer session: both shards of batch 0 count
    for name, sel, trust in (("a", half, "laplace"), ("b", ~half, "sigmoid")):
        w.write(**{k: v[sel] for k, v in cols.items()}, c=np.ones(int(sel.sum()), np.float32), name=f"{name}.parquet",
                allocation=deployed_block(dict(trust=trust), alloc_scope=None, ratio_source=None))
    with pytest.raises(DumpError, match=r"batch 0 also has rows in .*a\.parquet.*trust='laplace'"):
        verify_dumps([tmp_path / "d"])


def test_coeffs_output_verifies_against_the_settings_that_computed_it(tmp_path: Path) -> None:
    deploy(tmp_path / "d")
    out = tmp_path / "c.parquet"
    r = cli("audit", "coeffs", str(tmp_path / "d"), "--out", str(out), "--trust", "uniform")
    assert r.returncode == 0, r.stderr
    assert cli("audit", "verify", str(out)).returncode == 0  # float64 columns, computed with trust uniform
