"""SPEC 9 provenance: the blocks every producer writes, and what the writer and the drop-in put in each shard."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from icsd_audit.alloc.options import AllocatorOptions
from icsd_audit.dumps.provenance import (ALLOCATOR_KEYS, PRODUCER_KEYS, SettingsMismatch, allocator_block,
                                         deployed_block, producer_block, recorded_settings, relevant_keys)
from icsd_audit.dumps.reader import METADATA_KEY
from icsd_audit.dumps.writer import DumpWriter


def shard_meta(path: Path) -> dict:
    raw = pq.read_schema(path).metadata[METADATA_KEY.encode()]

    def refuse(name: str) -> float:
        raise AssertionError(f"non-finite number {name} written")

    return json.loads(raw, parse_constant=refuse)


def _rows(n: int = 4) -> dict:
    return dict(batch_id=np.zeros(n, int), traj_id=np.arange(n), turn_id=np.zeros(n, int), advantage=np.ones(n),
                ratio=np.ones(n), delta=np.ones(n))


def test_allocator_block_has_every_key_and_null_for_the_unknown() -> None:
    b = allocator_block(allocator="icsd", trust="sigmoid", trust_beta=np.float32(3.0), min_group=np.int64(4))
    assert tuple(b)[: len(ALLOCATOR_KEYS)] == ALLOCATOR_KEYS
    assert b == {"allocator": "icsd", "trust": "sigmoid", "trust_beta": 3.0, "trust_eta": None, "influence_eta": None,
                 "eps": None, "min_group": 4, "alloc_scope": None, "ratio_source": None, "seed": None}
    assert type(b["trust_beta"]) is float and type(b["min_group"]) is int
    # a dataclass works as settings; free keys follow the SPEC keys
    d = allocator_block(AllocatorOptions(trust="uniform"), alloc_scope="global", **{"lambda": 0.01})
    assert d["trust"] == "uniform" and d["trust_eta"] == 0.4 and d["influence_eta"] == 0.5 and d["lambda"] == 0.01


@pytest.mark.parametrize("bad, match", [
    (dict(eps=float("nan")), "'eps' is nan"),
    (dict(trust_beta=float("inf")), "'trust_beta' is inf"),
    (dict(alloc_scope="per-token"), "alloc_scope='per-token'"),
    (dict(min_group=2.5), "'min_group' must be an integer"),
    (dict(trust=3), "'trust' must be a non-empty string"),
    (dict(eps="small"), "'eps' must be a number"),
])
def test_allocator_block_refuses_settings_that_cannot_have_been_deployed(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        allocator_block(allocator="icsd", **bad)


def test_deployed_block_fills_what_allocate_used_by_default() -> None:
    b = deployed_block({"allocator": "icsd", "trust": "sigmoid"}, alloc_scope="mini-batch", ratio_source="fixed-1")
    # SPEC 2-3 defaults: beta 5, trust eta 0.4, influence eta 0.5, eps 1e-4, min_group 8; seed 0
    assert b == {"allocator": "icsd", "trust": "sigmoid", "trust_beta": 5.0, "trust_eta": 0.4, "influence_eta": 0.5,
                 "eps": 1e-4, "min_group": 8, "alloc_scope": "mini-batch", "ratio_source": "fixed-1", "seed": 0}
    with pytest.raises(ValueError, match="'gate_beta'"):
        deployed_block({"gate_beta": 5.0}, alloc_scope=None, ratio_source=None)


def test_producer_block_keys_engine_and_free_keys() -> None:
    p = producer_block({"name": "mine", "engine": "trl", "env": "webshop", "lr": float("nan")}, rank=2, world_size=4)
    assert tuple(p)[:6] == PRODUCER_KEYS
    assert p["engine"] == "trl" and p["engine_version"] is None and p["rank"] == 2 and p["world_size"] == 4
    assert p["env"] == "webshop" and p["lr"] is None  # a non-finite free value is written as null
    assert producer_block("x")["engine"] == "user"
    with pytest.raises(ValueError, match="engine 'deepspeed'"):
        producer_block({"name": "x", "engine": "deepspeed"})
    with pytest.raises(ValueError, match="rank must be a non-negative integer"):
        producer_block("x", rank=-1)


def test_dump_writer_with_allocation_writes_complete_blocks(tmp_path: Path) -> None:
    w = DumpWriter(tmp_path, producer={"name": "my-trainer", "run": "abc"}, rank=1, world_size=2,
                   allocation={"allocator": "sdar", "trust": "sigmoid", "trust_beta": 2.0},
                   metadata={"loss_scale": float("-inf")})
    first = shard_meta(w.write(**_rows()))
    assert first["allocator"] == allocator_block(allocator="sdar", trust="sigmoid", trust_beta=2.0)
    assert first["producer"] == {"name": "my-trainer", "engine": "user", "engine_version": None,
                                 "icsd_version": first["producer"]["icsd_version"], "rank": 1, "world_size": 2,
                                 "run": "abc"}
    assert first["loss_scale"] is None
    # a shard may carry its own settings; the writer's stay for the next one
    other = shard_meta(w.write(**_rows(), allocation={"allocator": "icsd", "eps": 1e-3}))
    assert other["allocator"]["allocator"] == "icsd" and other["allocator"]["trust"] is None
    assert shard_meta(w.write(**_rows()))["allocator"]["allocator"] == "sdar"
    # without settings every key is still there, each null
    bare = shard_meta(DumpWriter(tmp_path / "b", producer="x").write(**_rows()))
    assert bare["allocator"] == dict.fromkeys(ALLOCATOR_KEYS)
    with pytest.raises(ValueError, match="once"):
        DumpWriter(tmp_path / "c", producer="x", allocation={}, allocator={})


def test_relevant_keys_follow_the_allocator_and_trust() -> None:
    assert relevant_keys({"allocator": "icsd", "trust": "laplace"}) == (
        "allocator", "trust", "trust_eta", "influence_eta", "eps", "min_group")
    assert relevant_keys({"allocator": "sdar", "trust": "sigmoid"}) == ("allocator", "trust", "trust_beta", "eps",
                                                                         "min_group")
    assert relevant_keys({"allocator": "opsd", "trust": "sigmoid"}) == ("allocator", "eps", "min_group")
    assert "seed" in relevant_keys({"allocator": "permuted", "trust": "uniform"})


def test_recorded_settings_name_two_files_and_the_field() -> None:
    a = {"allocator": allocator_block(allocator="icsd", trust="laplace", trust_eta=0.4, trust_beta=5.0, seed=1)}
    same = {"allocator": allocator_block(allocator="icsd", trust="laplace", trust_eta=0.4, trust_beta=9.0, seed=7)}
    other = {"allocator": allocator_block(allocator="icsd", trust="sigmoid", trust_eta=0.4, trust_beta=5.0)}
    files = [Path("a.parquet"), Path("b.parquet"), Path("c.parquet")]
    # beta (laplace trust) and seed (not permuted) change no coefficient: one group
    rec = recorded_settings(files[:2], [a, same])
    assert rec is not None and rec.files == tuple(files[:2]) and rec.values["trust"] == "laplace"
    with pytest.raises(SettingsMismatch) as e:
        recorded_settings(files, [a, same, other])
    msg = str(e.value)
    assert "c.parquet" in msg and "a.parquet" in msg and "'trust'" in msg and "'sigmoid'" in msg and "\n" not in msg
    assert recorded_settings(files, [a, same, other], ignore=["trust"]) is not None
    # a file that records nothing is no disagreement: it takes the others' settings, and is listed
    mixed = recorded_settings(files[:2], [a, {}])
    assert mixed is not None and mixed.files == (files[0],) and mixed.unrecorded == (files[1],)
    assert recorded_settings(files[:1], [{}]) is None


def test_drop_in_writes_the_settings_it_deployed(tmp_path: Path) -> None:
    from tests.integrations.test_sdar import _dataproto

    from icsd_audit.integrations.sdar import allocate_dataproto, dump_writer

    dp, n = _dataproto(3)
    allocate_dataproto(dp, mini_batch_rows=None, trust="sigmoid", trust_beta=3.0, min_group=4, eps=1e-3,
                       writer=dump_writer(tmp_path, rank=0), dp_size=1)
    (shard,) = sorted(tmp_path.glob("*.parquet"))
    meta = shard_meta(shard)
    assert meta["allocator"] == {"allocator": "icsd", "trust": "sigmoid", "trust_beta": 3.0, "trust_eta": 0.4,
                                 "influence_eta": 0.5, "eps": 1e-3, "min_group": 4, "alloc_scope": "mini-batch",
                                 "ratio_source": "fixed-1", "seed": 0}
    p = meta["producer"]
    assert (p["name"], p["engine"], p["rank"], p["world_size"]) == ("icsd.verl-agent", "verl-agent", 0, 1)
    assert math.isfinite(float(torch.as_tensor(dp.batch["icsd_c"]).sum()))


def test_drop_in_run_with_non_default_settings_is_recomputed_and_verified_without_flags(tmp_path: Path) -> None:
    """Done-when of issue 25 for the verl-agent drop-in: coeffs (no flags) reproduces the deployed c, verify
    exits 0, and one altered c makes verify exit 1 naming that batch."""
    from tests.helpers import cli
    from tests.dumps.test_verify import alter
    from tests.integrations.test_sdar import _dataproto

    from icsd_audit.integrations.sdar import allocate_dataproto, dump_writer

    d = tmp_path / "dumps"
    for step in (0, 1):  # two steps of two mini-batches each, one shard per mini-batch
        dp, n = _dataproto(10 + step, n_traj=12)
        allocate_dataproto(dp, mini_batch_rows=(n + 1) // 2, step=step, writer=dump_writer(d, rank=0),
                           trust="sigmoid", trust_beta=2.0, min_group=3, eps=1e-3, allocator="icsd")
    shards = sorted(d.glob("*.parquet"))
    assert len(shards) == 4
    out = tmp_path / "c.parquet"
    r = cli("audit", "coeffs", str(d), "--out", str(out))
    assert r.returncode == 0 and "warning" not in r.stderr and "note" not in r.stderr, r.stderr
    stored = np.concatenate([pq.read_table(p).column("c").to_numpy() for p in shards])
    assert np.array_equal(pq.read_table(out).column("c").to_numpy().astype(np.float32), stored)
    # the defaults (laplace trust, min_group 8) would not have reproduced it
    r = cli("audit", "coeffs", str(d), "--out", str(tmp_path / "l.parquet"), "--trust", "laplace", "--min-group", "8",
            "--eps", "1e-4")
    assert not np.array_equal(pq.read_table(tmp_path / "l.parquet").column("c").to_numpy().astype(np.float32), stored)
    assert cli("audit", "verify", str(d)).returncode == 0
    c = pq.read_table(shards[3]).column("c").to_numpy()
    alter(shards[3], "c", 5, c[5] * 1.5 + 0.01)
    bid = int(pq.read_table(shards[3]).column("batch_id").to_numpy()[0])
    r = cli("audit", "verify", str(d))
    assert r.returncode == 1
    assert r.stdout.startswith(f"batch {bid} ({shards[3]}): c differs on 1 of ") and "1 of 4 batches differ" in r.stdout
