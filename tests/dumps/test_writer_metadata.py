"""A writer encodes its shard metadata once and reuses it; an edit of ``writer.metadata`` between shards still lands."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq

from icsd_audit.dumps.writer import DumpWriter


def _write(w: DumpWriter) -> dict:
    n = 4
    path = w.write(batch_id=np.zeros(n, np.int64), traj_id=np.arange(n), turn_id=np.zeros(n, np.int32),
                   advantage=np.ones(n), ratio=np.ones(n), delta=np.full(n, 0.5), c=np.ones(n))
    return json.loads(pq.read_schema(path).metadata[b"icsd.dump"])


def test_each_shard_carries_the_writers_metadata_as_it_is_when_written(tmp_path):
    w = DumpWriter(tmp_path, producer={"name": "test"}, rank=0, world_size=None)
    first = _write(w)
    assert first == _write(w)  # the same block, from the cache
    assert first["producer"]["name"] == "test" and first["producer"].get("world_size") is None
    w.metadata["producer"]["world_size"] = 4  # as integrations/sdar.py does once it knows the dp size
    third = _write(w)
    assert third["producer"]["world_size"] == 4 and {k: v for k, v in third.items() if k != "producer"} == \
        {k: v for k, v in first.items() if k != "producer"}
    fourth = _write(w)
    assert fourth == third
    with_alloc = w.write(batch_id=np.zeros(1, np.int64), traj_id=np.arange(1), turn_id=np.zeros(1, np.int32),
                         advantage=np.ones(1), ratio=np.ones(1), delta=np.ones(1), c=np.ones(1),
                         allocation={"allocator": "sdar"})
    assert json.loads(pq.read_schema(with_alloc).metadata[b"icsd.dump"])["allocator"]["allocator"] == "sdar"
    assert _write(w)["allocator"] == first["allocator"]  # a per-shard block does not stick
