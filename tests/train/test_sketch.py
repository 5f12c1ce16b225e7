"""Gradient sketches from the training loop (``sketch_k``): exact rows, dumps, gradcos, no effect on training."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from icsd_audit.alloc.settings import AllocatorSettings
from icsd_audit.train.config import ConfigError, TrainConfig
from tests.train.test_loop import SKILLS, tiny_cfg, varied_factory

torch.set_num_threads(1)  # 2 shared cores: a second OpenMP thread is slower here

K = 8


@pytest.fixture(scope="module")
def bank(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("bank") / "bank.json"
    p.write_text(json.dumps(SKILLS))
    return str(p)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, bank):
    """The same one-step run with and without sketching (2 actor mini-batches of 2 micro-batches)."""
    from icsd_audit.train.loop import train

    root = tmp_path_factory.mktemp("runs")
    on = train(tiny_cfg(root / "on", bank, sketch_k=K), env_factory=varied_factory())
    off = train(tiny_cfg(root / "off", bank), env_factory=varied_factory())
    return on, off


# ----------------------------------------------------------------------------- the actor's rows are exact


def _step_data(n_rows: int = 5, seed: int = 0):
    """Rows with ragged prompts/responses, distinct (traj, turn), old log-probs = the model's."""
    from icsd_audit.train.update.actor import StepData

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 259, (3 + 2 * i,), generator=g).tolist() for i in range(n_rows)]
    responses = [torch.randint(3, 259, (2 + (3 * i) % 5,), generator=g).tolist() for i in range(n_rows)]
    return StepData(prompts=prompts, responses=responses, old_logp=[], advantage=torch.randn(n_rows, generator=g),
                    traj=torch.arange(n_rows) // 2, turn=torch.arange(n_rows) % 2)


def test_actor_sketch_rows_are_the_exact_per_token_gradients():
    """Every dumped row's factors satisfy u_t v_t^T = P s_t Q^T, with s_t the exact gradient of
    log pi(a_t | x_t) for that row's token, taken by autograd on the row alone (no padding, full
    logits, one backward per token): checks the positions, the row layout and the values."""
    import copy

    from icsd_audit.train.models.loading import tiny_random_causal_lm
    from icsd_audit.grads.replay import per_token_gradients
    from icsd_audit.grads.sketch import GradientSketcher, shift_response_mask
    from icsd_audit.train.update.actor import Actor, Distillation
    from icsd_audit.train.update.logprobs import score_rows

    model, tok = tiny_random_causal_lm(seed=3)
    with torch.no_grad():  # wider than the default init, so per-token gradients differ visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    model.eval()
    # the reference: the same weights with the head untied from the input embedding, so that
    # autograd's lm_head.weight gradient is the head's use of the matrix, which is what the
    # sketch covers for a tied model (metadata "tied_lm_head")
    before = copy.deepcopy(model)
    before.lm_head.weight = torch.nn.Parameter(before.lm_head.weight.detach().clone())
    T = 0.8
    data = _step_data()
    cpu = torch.device("cpu")
    scored = score_rows(model, data.prompts, data.responses, [[i] for i in range(data.n_rows)], pad_id=tok.pad_token_id,
                        device=cpu, temperature=T)
    data.old_logp = [scored[i] for i in range(data.n_rows)]
    data.teacher_logp = [lp + 0.3 for lp in data.old_logp]
    sk = GradientSketcher(model, k_out=K, k_in=K, seed=5, temperature=T)
    actor = Actor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                  distill=Distillation(AllocatorSettings(allocator="icsd", min_group=2), coef=0.01),
                  clip_ratio=0.2, dual_clip=3.0, kl_coef=0.0, temperature=T, mini_batch_rows=5, micro_batch_rows=2,
                  ppo_epochs=1, grad_clip=1.0, skip_first_prepass=True, shuffle_rows=False, seed=0,
                  pad_id=tok.pad_token_id, device=cpu, sketcher=sk)
    got: list[dict] = []
    actor.update(0, data, sink=lambda name, cols: got.append(cols))
    assert len(got) == 1 and not sk.attached and sk.tied_lm_head
    cols = got[0]
    n = cols["pos"].shape[0]
    assert n == sum(len(r) for r in data.responses)
    # exact s_t per data row, at the weights the mini-batch's gradient was taken at
    names = sk.parameter_names()
    specs = list(sk.specs.values())
    exact: dict[int, torch.Tensor] = {}
    for i in range(data.n_rows):
        ids = torch.tensor([data.prompts[i] + data.responses[i]])
        resp = torch.zeros_like(ids, dtype=torch.bool)
        resp[0, len(data.prompts[i]):] = True
        _, pos = shift_response_mask(ids, resp)
        exact[i] = per_token_gradients(before, ids, pos, params=names, temperature=T)
    row_of = {(int(t), int(u)): i for i, (t, u) in enumerate(zip(data.traj, data.turn))}
    for r in range(n):
        i = row_of[(int(cols["traj_id"][r]), int(cols["turn_id"][r]))]
        assert cols["token_id"][r] == data.responses[i][cols["pos"][r]]
        s = exact[i][int(cols["pos"][r])]
        off = 0
        for spec in specs:
            g = s[off: off + spec.d_out * spec.d_in].reshape(spec.d_out, spec.d_in)
            off += spec.d_out * spec.d_in
            p = sk.projection_for(spec.name, "out").double()
            q = sk.projection_for(spec.name, "in").double()
            want = p @ g @ q.T
            u = torch.from_numpy(cols[f"sketch.{spec.name}.out"][r]).double()
            v = torch.from_numpy(cols[f"sketch.{spec.name}.in"][r]).double()
            assert torch.allclose(torch.outer(u, v), want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), (r, spec.name)


# ----------------------------------------------------------------------------- end to end


def test_dumps_carry_sketch_columns_and_metadata(runs):
    from icsd_audit.dumps.reader import DumpReader
    from icsd_audit.train.models.loading import tiny_random_causal_lm
    from icsd_audit.grads.sketch import auto_layers

    on, off = runs
    layers = auto_layers(tiny_random_causal_lm()[0])
    assert layers == ["lm_head", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_proj",
                      "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]
    reader = DumpReader([on.dumps_dir], columns=None)
    meta = reader.metadata()[0]["sketch"]
    assert [d["name"] for d in meta["layers"]] == layers
    assert all(d["k_out"] == K and d["k_in"] == K for d in meta["layers"])
    assert meta["projection"] == "gaussian" and meta["seed"] == 0 and meta["temperature"] == 1.0
    dims = {d["name"]: (d["d_out"], d["d_in"]) for d in meta["layers"]}
    assert dims["lm_head"] == (259, 32) and dims["model.layers.1.mlp.down_proj"] == (32, 64)
    batches = list(reader)
    assert [b.batch_id for b in batches] == [0, 1]
    for b in batches:
        names = [c for c in b.table.column_names if c.startswith("sketch.")]
        assert sorted(names) == sorted(f"sketch.{n}.{s}" for n in layers for s in ("out", "in"))
        for c in names:
            col = b.table.column(c).combine_chunks()
            assert str(col.type) == f"fixed_size_list<element: float>[{K}]" and len(col) == b.n_rows
            assert np.isfinite(col.flatten().to_numpy()).all()
    plain = DumpReader([off.dumps_dir], columns=None)
    assert "sketch" not in plain.metadata()[0]
    assert not any(c.startswith("sketch") for b in plain for c in b.table.column_names)


def test_sketching_leaves_training_unchanged(runs):
    """Same loss, gradient norm and metrics, the same dumped values, the same final weights."""
    from icsd_audit.dumps.reader import DumpReader
    from icsd_audit.train.models.loading import load_policy

    on, off = runs

    def strip(rec):
        return {k: v for k, v in rec.items() if not k.startswith("time/")}

    assert strip(on.records[0]) == strip(off.records[0])
    assert on.records[0]["time/sketch"] > 0 and off.records[0]["time/sketch"] == 0
    a = list(DumpReader([on.dumps_dir], columns=None))
    b = list(DumpReader([off.dumps_dir], columns=None))
    for x, y in zip(a, b):
        keep = [c for c in x.table.column_names if not c.startswith("sketch.")]
        assert keep == y.table.column_names
        assert x.table.select(keep).equals(y.table)  # train_logp of mini-batch 1 follows mini-batch 0's update
    wa = load_policy(str(on.checkpoint), device=torch.device("cpu"))[0].state_dict()
    wb = load_policy(str(off.checkpoint), device=torch.device("cpu"))[0].state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_gradcos_runs_on_training_dumps(runs):
    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.audit.gradcos import run_gradcos

    on, _ = runs
    s = run_gradcos([on.dumps_dir], base=AllocatorOptions(allocator="sdar"), compare=AllocatorOptions(allocator="icsd"),
                    permutations=3, n_resamples=100, blocks=2)
    assert s.batch_ids == (0, 1)
    vals = np.array(s.cos_base + s.cos_compare + s.cos_perm)
    assert np.isfinite(vals).all() and (np.abs(vals) <= 1 + 1e-6).all()
    assert s.gain.estimate == pytest.approx(np.mean(np.array(s.cos_compare) - np.array(s.cos_base)))
    res = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "audit", "gradcos", str(on.dumps_dir), "--json",
                          "--resamples", "100", "--permutations", "3", "--blocks", "2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [r["batch_id"] for r in out["batches"]] == [0, 1]
    assert all(np.isfinite(r["cos_icsd"]) and np.isfinite(r["cos_sdar"]) for r in out["batches"])


# ----------------------------------------------------------------------------- config and CLI


def test_sketch_config_is_validated_with_fixes():
    with pytest.raises(ConfigError) as err:
        TrainConfig(sketch_k=-1, sketch_layers=" , ").validate()
    msg = str(err.value)
    assert "sketch_k=-1 must be an integer >= 0" in msg and "sketch_layers=' , ' names no layer" in msg
    with pytest.raises(ConfigError, match="sketch_k=8 but this run writes no dumps.*or set sketch_k=0"):
        TrainConfig(sketch_k=8, allocator="none").validate()
    with pytest.raises(ConfigError, match="dump_every=0"):
        TrainConfig(sketch_k=8, dump_every=0).validate()
    TrainConfig(sketch_k=8).validate()


def test_bad_layer_names_fail_with_the_models_linears():
    from icsd_audit.train.models.loading import tiny_random_causal_lm
    from icsd_audit.train.update.sketching import make_sketcher, parse_layers

    model, _ = tiny_random_causal_lm()
    assert make_sketcher(TrainConfig(), model) is None
    sk = make_sketcher(TrainConfig(sketch_k=4, sketch_layers="lm_head, model.layers.1.mlp.down_proj"), model)
    assert sk is not None and sk.layer_names == ["lm_head", "model.layers.1.mlp.down_proj"]
    assert parse_layers(" auto ") == "auto"
    with pytest.raises(ConfigError, match="sketch_layers='model.nope'.*e.g. .*lm_head"):
        make_sketcher(TrainConfig(sketch_k=4, sketch_layers="model.nope"), model)


def test_cli_maps_sketch_options():
    from icsd_audit.cli.train import _build_config

    cfg = _build_config("cpu-demo", {"sketch_k": 16, "sketch_layers": "lm_head"}, ["sketch_seed=3"])
    assert (cfg.sketch_k, cfg.sketch_layers, cfg.sketch_seed) == (16, "lm_head", 3)
