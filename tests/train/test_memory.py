"""Memory savers change no number: activation recomputation and the per-pass reference."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import torch

from icsd_audit.train.update.logprobs import pack, response_logprobs
from icsd_audit.train.loop import train
from icsd_audit.train.models.memory import checkpointed_blocks, decoder_blocks, release_freed_memory
from icsd_audit.train.models.loading import tiny_random_causal_lm

from .test_loop import bank, tiny_cfg, varied_factory  # noqa: F401  (bank is a fixture)


def _grads(model, packed, recompute: bool, skip=()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ctx = checkpointed_blocks(model, skip=skip) if recompute else torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t)
    with ctx:
        lp = response_logprobs(model, packed, temperature=0.7)
    (lp.sum() * 0.37).backward()
    return lp.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _counting(model) -> dict[str, int]:
    calls: dict[str, int] = {}
    for name, block in decoder_blocks(model):  # the recompute calls forward, so hook a submodule
        block.mlp.register_forward_pre_hook(lambda m, a, _n=name: calls.__setitem__(_n, calls.get(_n, 0) + 1))
    return calls


def test_recomputed_blocks_give_bit_identical_logprobs_and_gradients() -> None:
    model, _ = tiny_random_causal_lm(seed=3, num_layers=3)
    model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (17, 9, 30)]
    responses = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 8, 2)]
    packed = pack(prompts, responses, pad_id=0, device="cpu")
    lp0, g0 = _grads(model, packed, recompute=False)
    calls = _counting(model)
    lp1, g1 = _grads(model, packed, recompute=True, skip=["model.layers.2.mlp.down_proj"])
    assert torch.equal(lp0, lp1)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    # blocks 0 and 1 ran again in the backward; block 2 (holding a skipped layer) ran once
    assert calls == {"model.layers.0": 2, "model.layers.1": 2, "model.layers.2": 1}
    # the patch is gone afterwards: a plain forward runs each block once
    calls.clear()
    with torch.no_grad():
        response_logprobs(model, packed)
    assert calls == {"model.layers.0": 1, "model.layers.1": 1, "model.layers.2": 1}


def _non_time(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in path.read_text().splitlines()]


def test_memory_savers_leave_metrics_and_dumps_unchanged(tmp_path: Path, bank: str) -> None:  # noqa: F811
    plain = train(tiny_cfg(tmp_path / "plain", bank, total_steps=2, kl_coef=0.05, sketch_k=4,
                           recompute_activations=False, resident_reference=True, spill_optimizer_state=False,
                           checkpoint_every=1), env_factory=varied_factory())
    lean = train(tiny_cfg(tmp_path / "lean", bank, total_steps=2, kl_coef=0.05, sketch_k=4,
                          recompute_activations=True, resident_reference=False, spill_optimizer_state=True,
                          checkpoint_every=1), env_factory=varied_factory())
    assert _non_time(plain.metrics_path) == _non_time(lean.metrics_path)
    shards = sorted(str(p.relative_to(plain.dumps_dir)) for p in plain.dumps_dir.rglob("*.parquet"))
    assert shards == sorted(str(p.relative_to(lean.dumps_dir)) for p in lean.dumps_dir.rglob("*.parquet"))
    assert len(shards) >= 2
    for name in shards:
        a, b = pq.read_table(plain.dumps_dir / name), pq.read_table(lean.dumps_dir / name)
        assert a.column_names == b.column_names and any(c.startswith("sketch.") for c in a.column_names)
        for col in a.column_names:
            assert a.column(col).equals(b.column(col)), (name, col)
    # the checkpoints' optimizer state (spilled and read back in between) is the same too
    from icsd_audit.train.run.checkpoint import load_trainer_state

    sa = load_trainer_state(plain.checkpoint)["optimizer"]["state"]
    sb = load_trainer_state(lean.checkpoint)["optimizer"]["state"]
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k][name], sb[k][name]) and sa[k][name].numel() > 0
    assert not list(lean.out_dir.glob("tmp*"))  # the spill file was never visible


def test_optimizer_spill_round_trip_is_exact_and_frees_the_state(tmp_path: Path) -> None:
    from icsd_audit.train.models.memory import OptimizerSpill

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(50, 7))
    ref = torch.nn.Parameter(w.detach().clone())
    opt, opt_ref = torch.optim.AdamW([w], lr=0.1), torch.optim.AdamW([ref], lr=0.1)
    spill = OptimizerSpill(opt, directory=str(tmp_path))
    for i in range(3):
        g = torch.randn(50, 7)
        w.grad, ref.grad = g.clone(), g.clone()
        with spill.resident():
            opt.step()
        opt_ref.step()
        assert spill.spilled and opt.state[w]["exp_avg"].numel() == 0  # nothing in memory between steps
        assert torch.equal(w, ref)
    with spill.resident():
        assert torch.equal(opt.state[w]["exp_avg_sq"], opt_ref.state[ref]["exp_avg_sq"])
    spill.close()
    assert not spill.spilled and torch.equal(opt.state[w]["exp_avg"], opt_ref.state[ref]["exp_avg"])


def test_release_freed_memory_is_safe_to_call() -> None:
    assert release_freed_memory() in (True, False)


def test_map_large_allocations_is_safe_to_call() -> None:
    import sys

    from icsd_audit.train.models.memory import map_large_allocations

    assert map_large_allocations() is (sys.platform.startswith("linux"))  # glibc on Linux
