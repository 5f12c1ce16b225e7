"""``weighted_batches``: threads allocate batches at once, results identical and in input order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from icsd_audit.alloc.options import AllocatorOptions, weight_pair, weighted_batches
from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.tokens import Tokens


@dataclass(frozen=True)
class _Batch:
    tokens: Tokens
    label: int


def _batches(n: int) -> list[_Batch]:
    out = []
    for i in range(n):
        cols = synth_tokens(3000 + 700 * i, seed=10 + i, n_batches=1)
        out.append(_Batch(Tokens(advantage=cols["advantage"], ratio=cols["ratio"], delta=cols["delta"],
                                 traj_id=cols["traj_id"], turn_id=cols["turn_id"], batch_id=cols["batch_id"]), i))
    return out


def test_threads_give_the_serial_weights_in_input_order() -> None:
    batches = _batches(7)
    base, compare = AllocatorOptions(allocator="sdar"), AllocatorOptions(allocator="icsd")
    # the reference: one weight_pair call per batch, in order, in this thread
    ref = [weight_pair(b.tokens, base, compare) for b in batches]
    for workers in (1, 2, 3, 8):
        got = list(weighted_batches(iter(batches), base, compare, workers=workers))
        assert [b.label for b, _, _ in got] == list(range(7))
        for (_, w, u), (rw, ru) in zip(got, ref):
            assert np.array_equal(w.base, rw.base) and np.array_equal(w.compare, rw.compare)
            assert np.array_equal(u, ru)
            assert (w.base_name, w.compare_name) == ("sdar", "icsd")


def test_an_error_surfaces_in_order(monkeypatch) -> None:
    import icsd_audit.alloc.options as options

    batches = _batches(4)
    poisoned = batches[1].tokens

    def failing(tokens: Tokens, *args: object) -> object:
        if tokens is poisoned:
            raise ValueError("bad batch")
        return weight_pair(tokens, *args)

    monkeypatch.setattr(options, "weight_pair", failing)
    seen: list[object] = []
    base, compare = AllocatorOptions(allocator="sdar"), AllocatorOptions(allocator="icsd")
    try:
        for b, _, _ in weighted_batches(iter(batches), base, compare, workers=2):
            seen.append(b.label)
    except ValueError as exc:
        seen.append(str(exc))
    assert seen == [0, "bad batch"]
