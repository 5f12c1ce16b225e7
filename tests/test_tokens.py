"""The token object: alignment checks, conversions, and that every consumer accepts it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from icsd_audit import Tokens, Weights, allocate, read_dumps, tcm
from icsd_audit.alloc.permutation import permuted_coefficients
from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import DumpWriter


def _cols(n: int = 400, seed: int = 3) -> dict[str, np.ndarray]:
    return synth_tokens(n, seed=seed, n_batches=2)


def test_arrays_must_be_aligned_and_one_dimensional() -> None:
    c = _cols()
    kw = {k: c[k] for k in ("advantage", "ratio", "delta", "traj_id", "turn_id")}
    with pytest.raises(ValueError, match="delta: length 399 differs from advantage's 400"):
        Tokens(**{**kw, "delta": c["delta"][:-1]})
    with pytest.raises(ValueError, match="expected a 1-D array"):
        Tokens(**{**kw, "ratio": c["ratio"].reshape(20, 20)})
    with pytest.raises(ValueError, match="column 'pos'"):
        Tokens(**kw, columns={"pos": np.arange(3)})
    with pytest.raises(TypeError, match="1-D numpy array or torch tensor"):
        Tokens(**{**kw, "advantage": list(c["advantage"])})
    t = Tokens(**kw)
    assert len(t) == t.n == 400
    with pytest.raises(KeyError, match="no 'step' column"):
        t.column("step")


def test_conversions_share_memory() -> None:
    c = _cols()
    t = Tokens.from_mapping(c)
    tt = t.torch()
    assert isinstance(tt.delta, torch.Tensor) and tt.delta.data_ptr() == t.delta.__array_interface__["data"][0]
    back = tt.numpy()
    assert np.shares_memory(back.delta, t.delta) and np.shares_memory(back.valid, t.valid) and back.u is None


def test_allocate_takes_tokens_or_keywords_identically() -> None:
    c = _cols()
    t = Tokens.from_mapping({k: c[k].astype(np.float64) if c[k].dtype.kind == "f" else c[k] for k in c})
    a = allocate(t, allocator="icsd")
    tt = t.torch()
    b = allocate(advantage=tt.advantage, ratio=tt.ratio, delta=tt.delta, traj_id=tt.traj_id, turn_id=tt.turn_id,
                 batch_id=tt.batch_id, allocator="icsd")
    assert torch.equal(a.c, b.c) and torch.equal(a.g, b.g)
    with pytest.raises(TypeError, match="not both"):
        allocate(t, advantage=tt.advantage)
    with pytest.raises(TypeError, match="missing token arrays: turn_id"):
        allocate(advantage=tt.advantage, ratio=tt.ratio, delta=tt.delta, traj_id=tt.traj_id)
    p = permuted_coefficients(t, seeds=[1])
    assert torch.equal(p[:, 0], allocate(t, allocator="permuted", seed=1).c)


def test_reader_yields_tokens_with_requested_columns(tmp_path: Path) -> None:
    c = _cols()
    c["step"] = np.full(400, 7, dtype=np.int64)
    DumpWriter(tmp_path, producer={"name": "test"}, synthetic=True).write(**c)
    batches = list(read_dumps(tmp_path, columns=["step"]))
    assert len(batches) == 2 and all(isinstance(b, Tokens) for b in batches)
    assert sum(len(b) for b in batches) == 400
    assert set(batches[0].columns) >= {"step", "pos"} and (batches[0].column("step") == 7).all()
    # the statistics take the same object: a by-column grouping by name
    out = allocate(batches[0])
    res = tcm(batches[0], Weights(out.g.numpy(), out.c.numpy()), by="step", n_resamples=100, rng=0)
    assert res.by == "step" and res.keys == (7,)
