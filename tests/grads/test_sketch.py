"""Per-token gradient sketches (icsd_audit.grads.sketch) on a tiny random Llama: exactness and hook hygiene."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from icsd_audit.grads import compat as gradcompat
from icsd_audit.grads.sketch import (
    DEFAULT_K,
    GradientSketcher,
    SketchResult,
    auto_layers,
    layer_seed,
    projection_matrix,
    shift_response_mask,
    sketch_column_names,
    token_logprobs_from_logits,
)

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)  # 2 shared cores: a second OpenMP thread is slower here


# --------------------------------------------------------------------------- fixtures shared with test_replay


def tiny_llama(seed: int = 0, tie: bool = False, bias: bool = False, layers: int = 2):
    """A 2-layer, hidden-32, vocab-100 LlamaForCausalLM, randomly initialised (no download)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attention_bias=bias,
        mlp_bias=bias,
    )
    model = transformers.LlamaForCausalLM(cfg)
    # the default init (std 0.02) gives near-uniform softmaxes; widen it so gradients differ across tokens
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    return model.eval()


def tiny_batch(seed: int = 0, b: int = 3, t: int = 12, vocab: int = 100):
    """Right-padded ids, attention mask and a response mask (prompt of 4 tokens, ragged lengths)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    lengths = torch.tensor([t - (i % 3) for i in range(b)])
    am = (torch.arange(t)[None, :] < lengths[:, None]).long()
    resp = am.bool() & (torch.arange(t)[None, :] >= 4)
    return ids, am, resp


def sketch_step(model, ids, am, resp, temperature=1.0, how="logp", **kw):
    """One forward with the sketcher attached; returns (result, sketcher)."""
    targets, pos = shift_response_mask(ids, resp)
    sk = GradientSketcher(model, temperature=temperature, grad_source="backward" if how == "backward" else "collect", **kw)
    with sk:
        logits = model(input_ids=ids, attention_mask=am).logits
        if how == "logp":
            res = sk.collect(pos, logp=token_logprobs_from_logits(logits, targets, temperature))
        elif how == "targets":
            res = sk.collect(pos, targets=targets)
        elif how == "both":
            res = sk.collect(pos, targets=targets, logp=token_logprobs_from_logits(logits, targets, temperature))
        else:
            lp = token_logprobs_from_logits(logits, targets, temperature)
            (lp * pos).sum().backward()
            res = sk.collect(pos)
    return res, sk


# --------------------------------------------------------------------------- projections


def test_projection_matrix_seeded_and_scaled():
    a = projection_matrix("gaussian", 64, 500, seed=3)
    b = projection_matrix("gaussian", 64, 500, seed=3)
    c = projection_matrix("gaussian", 64, 500, seed=4)
    assert a.shape == (64, 500) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)
    # E[P^T P] = I: the diagonal of P^T P averages 1, off-diagonals average 0
    ptp = (a.double().T @ a.double())
    assert abs(ptp.diagonal().mean().item() - 1.0) < 0.03
    r = projection_matrix("rademacher", 16, 40, seed=1)
    assert torch.allclose(r.abs(), torch.full_like(r, 1 / math.sqrt(16)))
    assert torch.equal(projection_matrix("identity", 5, 5, seed=0), torch.eye(5))
    with pytest.raises(ValueError):
        projection_matrix("identity", 4, 5, seed=0)
    with pytest.raises(ValueError):
        projection_matrix("sparse", 4, 5, seed=0)  # type: ignore[arg-type]


def test_layer_seed_is_stable_and_layer_specific():
    assert layer_seed(0, "lm_head", "out") == layer_seed(0, "lm_head", "out")
    seeds = {layer_seed(0, n, s) for n in ("lm_head", "x.o_proj") for s in ("out", "in")}
    assert len(seeds) == 4
    assert layer_seed(1, "lm_head", "out") != layer_seed(0, "lm_head", "out")


def test_auto_layers_llama_and_qwen2():
    model = tiny_llama()
    assert auto_layers(model) == [
        "lm_head",
        "model.layers.1.self_attn.o_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
    ]
    cfg = transformers.Qwen2Config(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )
    qwen = transformers.Qwen2ForCausalLM(cfg)
    assert auto_layers(qwen)[0] == "lm_head"
    assert auto_layers(qwen)[1:] == [f"model.layers.2.{s}" for s in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


# --------------------------------------------------------------------------- exactness (identity projection)


@pytest.mark.parametrize("how", ["logp", "targets", "both", "backward"])
@pytest.mark.parametrize("bias", [False, True])
def test_kronecker_factors_equal_materialised_per_token_gradients(how, bias):
    """With P = Q = I the factors are g_t and x_t: g_t x_t^T must equal s_t of a per-token backward."""
    from icsd_audit.grads.replay import per_token_gradients

    temperature = 0.7
    model = tiny_llama(seed=1, bias=bias)
    ids, am, resp = tiny_batch(seed=2)
    res, sk = sketch_step(model, ids, am, resp, temperature, how, projection="identity")
    _, pos = shift_response_mask(ids, resp)
    names = sk.parameter_names()
    if bias:
        assert any(n.endswith(".bias") for n in names)
    ref = per_token_gradients(model, ids, pos, attention_mask=am, params=names, temperature=temperature)
    n = int(pos.sum())
    assert res.n_tokens == n and ref.shape[0] == n

    params = dict(model.named_parameters())
    offset = 0
    w = torch.rand(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for layer, spec in sk.specs.items():
        u, v = (x.double() for x in res.layers[layer])
        per_tok = torch.einsum("ti,tj->tij", u, v)  # (n, d_out, d_in [+1 for bias])
        size_w = params[f"{layer}.weight"].numel()
        ref_w = ref[:, offset : offset + size_w].reshape(n, spec.d_out, -1)
        offset += size_w
        if spec.has_bias:
            ref_b = ref[:, offset : offset + spec.d_out]
            offset += spec.d_out
            ref_w = torch.cat([ref_w, ref_b[:, :, None]], dim=2)
        scale = ref_w.abs().max().item()
        assert scale > 0
        torch.testing.assert_close(per_tok, ref_w, atol=1e-5 * scale, rtol=1e-4)
        # weighted sums: U^T diag(w) V == sum_t w_t s_t (the offline estimator's target)
        m = gradcompat.direction_sketch({layer: (u, v)}, w)[layer]
        torch.testing.assert_close(m, torch.einsum("tp,tij->pij", w, ref_w), atol=1e-5 * scale * n, rtol=1e-4)
    assert offset == ref.shape[1]


@pytest.mark.parametrize("how", ["targets", "both", "backward"])
def test_analytic_head_factor_matches_autograd(how):
    model = tiny_llama(seed=3)
    ids, am, resp = tiny_batch(seed=4)
    a, _ = sketch_step(model, ids, am, resp, 1.3, how, k_out=24, k_in=24, seed=5)
    b, _ = sketch_step(model, ids, am, resp, 1.3, "logp", k_out=24, k_in=24, seed=5)
    for layer in a.layers:
        torch.testing.assert_close(a.layers[layer][0], b.layers[layer][0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.layers[layer][1], b.layers[layer][1])


def test_logp_inconsistent_with_the_head_is_rejected():
    """A logp that is not log_softmax(head output / T)[target] (wrong T, post-processed logits) must not pass."""
    model = tiny_llama(seed=3)
    ids, am, resp = tiny_batch(seed=4)
    targets, pos = shift_response_mask(ids, resp)
    sk = GradientSketcher(model, temperature=1.0, k_out=8, k_in=8)
    with sk:
        logits = model(input_ids=ids, attention_mask=am).logits
        with pytest.raises(ValueError, match="post-processes"):
            sk.collect(pos, targets=targets, logp=token_logprobs_from_logits(logits, targets, 2.0))


def test_head_only_with_targets_runs_no_backward():
    model = tiny_llama(seed=3)
    ids, am, resp = tiny_batch(seed=4)
    targets, pos = shift_response_mask(ids, resp)
    sk = GradientSketcher(model, layers=["lm_head"], k_out=8, k_in=8)
    with sk, torch.no_grad():  # no graph at all: the head's factors come from the forward alone
        model(input_ids=ids, attention_mask=am)
        res = sk.collect(pos, targets=targets)
    assert res.layers["lm_head"][0].shape == (int(pos.sum()), 8)
    with sk, torch.no_grad():
        model(input_ids=ids, attention_mask=am)
        with pytest.raises(ValueError):
            sk.collect(pos, targets=torch.full_like(targets, -1))


# --------------------------------------------------------------------------- hook hygiene


def test_hooks_do_not_change_training_gradients_and_release_the_graph():
    model = tiny_llama(seed=6)
    ids, am, resp = tiny_batch(seed=7)
    targets, pos = shift_response_mask(ids, resp)

    def train_step(with_sketch: bool):
        model.zero_grad(set_to_none=True)
        sk = GradientSketcher(model, k_out=16, k_in=16)
        if with_sketch:
            sk.attach()
        logits = model(input_ids=ids, attention_mask=am).logits
        lp = token_logprobs_from_logits(logits, targets)
        res = None
        if with_sketch:
            res = sk.collect(pos, logp=lp, targets=targets)
            assert all(p.grad is None for p in model.parameters()), "collect must not touch .grad"
        loss = -(lp * pos).sum() + logits.square().mean()  # any trainer loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return grads, res, sk

    plain, _, _ = train_step(False)
    sketched, res, sk = train_step(True)
    for n in plain:
        torch.testing.assert_close(sketched[n], plain[n], rtol=0, atol=0)
    # nothing graph-connected survives collect(); detach() removes every hook
    assert not sk._in and not sk._out and not sk._gout and sk._logits is None and sk._head_input is None
    for u, v in res.layers.values():
        assert not u.requires_grad and not v.requires_grad and u.grad_fn is None
    sk.detach()
    assert all(not m._forward_hooks for m in model.modules())


def test_collect_errors_are_explicit():
    model = tiny_llama()
    ids, am, resp = tiny_batch()
    targets, pos = shift_response_mask(ids, resp)
    sk = GradientSketcher(model, k_out=8, k_in=8)
    with pytest.raises(RuntimeError):
        sk.collect(pos)
    with sk:
        model(input_ids=ids, attention_mask=am)
        with pytest.raises(ValueError):
            sk.collect(pos[:, :-1], targets=targets)
    with sk:
        model(input_ids=ids, attention_mask=am)
        with pytest.raises(ValueError):
            sk.collect(pos)  # neither logp nor targets
    with pytest.raises(ValueError):
        GradientSketcher(model, layers=["model.layers.1.mlp"])  # not a Linear
    with pytest.raises(ValueError):
        GradientSketcher(model, temperature=0.0)


# --------------------------------------------------------------------------- outputs


def test_columns_metadata_and_round_trip():
    pa = pytest.importorskip("pyarrow")
    model = tiny_llama(seed=8, tie=True)
    ids, am, resp = tiny_batch(seed=9)
    res, sk = sketch_step(model, ids, am, resp, 1.0, "targets", k_out=12, k_in=10, seed=11)
    n = res.n_tokens
    cols = res.columns()
    assert set(cols) == {c for layer in sk.layer_names for c in sketch_column_names(layer)}
    for name, arr in cols.items():
        assert arr.dtype == np.float32 and arr.shape == (n, 12 if name.endswith(".out") else 10)
    arrow = res.arrow_columns()
    col = arrow["sketch.lm_head.out"]
    assert pa.types.is_fixed_size_list(col.type) and col.type.list_size == 12 and col.type.value_type == pa.float32()
    table = pa.table(arrow)
    back = gradcompat.factors_from_columns({c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names})
    assert list(back) == sk.layer_names
    for layer, (u, v) in back.items():
        np.testing.assert_array_equal(u.numpy(), cols[sketch_column_names(layer)[0]])
        np.testing.assert_array_equal(v.numpy(), cols[sketch_column_names(layer)[1]])
    meta = json.loads(res.metadata_json())
    assert meta["projection"] == "gaussian" and meta["seed"] == 11 and meta["temperature"] == 1.0
    assert meta["tied_lm_head"] is True
    assert [l["name"] for l in meta["layers"]] == sk.layer_names
    head = meta["layers"][0]
    assert (head["d_out"], head["d_in"], head["k_out"], head["k_in"]) == (100, 32, 12, 10)
    # the projection is reproducible from the metadata alone
    p = projection_matrix(meta["projection"], head["k_out"], head["d_out"], head["seed_out"])
    assert torch.equal(p, sk.projection_for("lm_head", "out"))


def test_cat_concatenates_micro_batches():
    model = tiny_llama(seed=1)
    parts = []
    for s in range(2):
        ids, am, resp = tiny_batch(seed=s)
        parts.append(sketch_step(model, ids, am, resp, 1.0, "targets", k_out=8, k_in=8)[0])
    both = SketchResult.cat(parts)
    assert both.n_tokens == parts[0].n_tokens + parts[1].n_tokens
    assert DEFAULT_K == 128


def test_bfloat16_model_sketches_close_to_float32():
    """Half-precision models work: factors are float32 and close to the float32 model's."""
    model = tiny_llama(seed=2)
    ids, am, resp = tiny_batch(seed=3)
    ref, _ = sketch_step(model, ids, am, resp, 1.0, "both", k_out=16, k_in=16)
    half, _ = sketch_step(model.to(torch.bfloat16), ids, am, resp, 1.0, "both", k_out=16, k_in=16)
    for layer in ref.layers:
        for r, h in zip(ref.layers[layer], half.layers[layer]):
            assert h.dtype == torch.float32
            assert (h - r).norm() <= 0.08 * r.norm(), layer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_matches_cpu():
    model = tiny_llama(seed=2)
    ids, am, resp = tiny_batch(seed=3)
    cpu, _ = sketch_step(model, ids, am, resp, 1.0, "logp", k_out=16, k_in=16)
    model_gpu = model.to("cuda")
    gpu, _ = sketch_step(model_gpu, ids.cuda(), am.cuda(), resp.cuda(), 1.0, "logp", k_out=16, k_in=16)
    for layer in cpu.layers:
        assert gpu.layers[layer][0].device.type == "cuda"
        torch.testing.assert_close(gpu.layers[layer][0].cpu(), cpu.layers[layer][0], atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(gpu.layers[layer][1].cpu(), cpu.layers[layer][1], atol=1e-4, rtol=1e-3)
