"""The dumps' ``entropy`` column (SPEC 11): the student's next-token entropy, from the logits that gave ``logp``.

References are worked independently: a plain unpadded forward of the prompt and the
response, softmax in float64, H = -sum p log p.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from icsd_audit.train.update.logprobs import entropy_from_logits


def _entropy64(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * logp).sum(-1)


def test_entropy_from_logits_against_float64() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=g) * torch.tensor([0.1, 3.0, 30.0])[:, None, None]
    logits[2, 0] = -1e4  # a flat row: log(50)
    logits[2, 0, 7] = 80.0  # ... except one token that takes all the mass: entropy ~0
    logits[1, 1, :10] = float("-inf")  # masked vocabulary entries: probability 0, no NaN
    got = entropy_from_logits(logits, torch.logsumexp(logits, -1))
    want = _entropy64(logits.masked_fill(torch.isinf(logits), -1e30))
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert float(got[2, 0]) == pytest.approx(0.0, abs=1e-6)
    flat = torch.zeros(50)
    assert float(entropy_from_logits(flat, torch.logsumexp(flat, -1))) == pytest.approx(np.log(50), abs=1e-6)


def test_train_dumps_carry_the_entropy_of_the_model_logits(tmp_path, monkeypatch) -> None:
    """``icsd train --model tiny-random --steps 1``: every dumped token's entropy equals the entropy of the
    policy's next-token distribution at that token, computed from a plain forward with the weights of
    the pass that gave the token's ``logp`` (the gradient forward of the first mini-batch, the
    pre-pass of the later ones), to 1e-5."""
    from typer.testing import CliRunner

    import icsd_audit.train.update.actor as actor_mod
    import icsd_audit.train.update.logprobs as lp_mod
    from icsd_audit.cli.main import app

    expected: list[tuple[tuple[int, ...], np.ndarray]] = []
    original = lp_mod.response_logprobs

    def recording(model, packed, *, temperature=1.0, with_score_norm=False, with_entropy=False):
        if with_entropy:  # the passes whose logits give the dumped entropy: reference first, same weights
            with torch.no_grad():
                for i, n in enumerate(packed.lengths):
                    ids = packed.input_ids[i][packed.attention_mask[i].bool()]
                    logits = model(input_ids=ids[None]).logits[0, -n - 1 : -1].double() / temperature
                    expected.append((tuple(ids[-n:].tolist()), _entropy64(logits).numpy()))
        return original(model, packed, temperature=temperature, with_score_norm=with_score_norm,
                        with_entropy=with_entropy)

    monkeypatch.setattr(lp_mod, "response_logprobs", recording)
    monkeypatch.setattr(actor_mod, "response_logprobs", recording)
    run = tmp_path / "run"
    sets = ["group_size=2", "max_turns=2", "max_response_tokens=8", "max_prompt_tokens=384", "micro_batch_rows=2",
            "mini_batch_rows=2", "threads=1", "sketch_k=0"]
    res = CliRunner().invoke(app, ["train", "--model", "tiny-random", "--steps", "1", "--out", str(run), "--plain",
                                   *[a for s in sets for a in ("--set", s)]])
    assert res.exit_code == 0, res.output
    t = pq.read_table(run / "dumps")
    assert t.schema.field("entropy").type == "float"  # float32
    cols = {k: t.column(k).to_numpy() for k in ("batch_id", "traj_id", "turn_id", "pos", "token_id", "entropy")}
    assert len(np.unique(cols["batch_id"])) >= 2  # the gradient-forward path and the pre-pass path
    by_tokens: dict[tuple[int, ...], list[np.ndarray]] = {}
    for ids, h in expected:
        by_tokens.setdefault(ids, []).append(h)
    key = np.stack([cols["batch_id"], cols["traj_id"], cols["turn_id"]], 1)
    turns = np.unique(key, axis=0)
    matched = 0
    for k in turns:
        sel = np.flatnonzero((key == k).all(1))
        sel = sel[np.argsort(cols["pos"][sel])]
        cands = by_tokens.get(tuple(cols["token_id"][sel].tolist()), [])
        assert cands, f"turn {k.tolist()}: no recorded pass scored these tokens"
        got = cols["entropy"][sel].astype(np.float64)
        assert any(np.abs(got - h).max() <= 1e-5 for h in cands), (got, cands)
        matched += 1
    assert matched == len(turns) > 0
    assert (cols["entropy"] >= 0).all() and (cols["entropy"] <= np.log(50_000)).all()
