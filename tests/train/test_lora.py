"""LoRA (peft): adapter-only checkpoints, exact dumps, the adapter-off reference, warm starts, eval and export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft", reason="peft not installed: pip install -e '.[train]'")

from tests.train.test_loop import SKILLS, tiny_cfg, varied_factory  # noqa: E402


@pytest.fixture(scope="module")
def bank(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("bank") / "bank.json"
    p.write_text(json.dumps(SKILLS))
    return str(p)


def _icsd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "ICSD_THREADS": "1"})


def _adapter_numel(model: torch.nn.Module, rank: int) -> int:
    """r * (in + out) for every linear of the decoder blocks (peft's all-linear: not the LM head)."""
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            n += rank * (mod.in_features + mod.out_features)
    return n


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


# ----------------------------------------------------------------------------- the CLI run of the issue


def test_cli_lora_run_writes_adapter_only_checkpoint_and_dumps_audit_recomputes(tmp_path):
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    from icsd_audit.train.models.loading import tiny_random_causal_lm

    run = tmp_path / "D"
    r = _icsd("train", "--model", "tiny-random", "--lora", "4", "--steps", "1", "--out", str(run), "--plain")
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = run / "checkpoints" / "step-000000"
    names = sorted(p.name for p in ckpt.iterdir())
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names and "icsd_adapter.json" in names
    assert not [n for n in names if n.startswith("model") or n.endswith(".bin")]  # no base weights
    tensors = load_file(str(ckpt / "adapter_model.safetensors"))
    assert tensors and all("lora_A" in k or "lora_B" in k for k in tensors)
    base, _ = tiny_random_causal_lm(seed=0)
    want = _adapter_numel(base, 4)  # 2 blocks x 7 linears x 4 x (in + out)
    assert sum(t.numel() for t in tensors.values()) == want
    from icsd_audit.train.run.checkpoint import load_trainer_state

    state = load_trainer_state(ckpt)
    moments = [s for s in state["optimizer"]["state"].values()]
    assert len(moments) == len(tensors)  # AdamW state for the adapter tensors only
    assert sum(s["exp_avg"].numel() for s in moments) == want
    meta = json.loads((ckpt / "icsd_adapter.json").read_text())
    assert meta["base_model"] == "tiny-random" and meta["base_seed"] == 0
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "targets": "all-linear"}
    # the dumps: cpu-demo's sketches work on the wrapped model; the audit recomputes c exactly
    shards = sorted((run / "dumps").rglob("*.parquet"))
    assert shards
    first = pq.read_table(shards[0])
    assert any(c.startswith("sketch.") and "base_layer" in c for c in first.column_names)
    out = tmp_path / "c.parquet"
    a = _icsd("audit", "coeffs", str(run / "dumps"), "--out", str(out))
    assert a.returncode == 0, a.stderr
    got = pq.read_table(out)
    dumped = np.concatenate([pq.read_table(p).column("c").to_numpy() for p in shards])
    assert got.num_rows == dumped.size > 0
    assert np.array_equal(got.column("c").to_numpy().astype(np.float32), dumped)
    v = _icsd("audit", "verify", str(run / "dumps"))  # the shards' own provenance reproduces them
    assert v.returncode == 0 and "every batch agrees" in v.stderr + v.stdout, v.stderr


# ----------------------------------------------------------------------------- library-level checks


def test_lora_dumps_are_recomputed_exactly_on_varied_rewards(tmp_path, bank):
    from icsd_audit.alloc.options import AllocatorOptions, allocate_batch
    from icsd_audit.dumps.reader import DumpReader
    from icsd_audit.train.loop import train

    cfg = tiny_cfg(tmp_path / "run", bank, lora_rank=4)
    res = train(cfg, env_factory=varied_factory())
    opts = AllocatorOptions(allocator="icsd", trust=cfg.trust, min_group=cfg.min_group, eps=cfg.alloc_eps)
    reader = DumpReader([res.dumps_dir], columns=None)
    assert reader.metadata()[0]["producer"]["lora"] == {"rank": 4, "alpha": 8.0, "targets": "all-linear"}
    n = 0
    for batch in reader:
        alloc = allocate_batch(batch.tokens, opts)
        assert np.abs(batch.tokens.advantage).max() > 0.01
        for k in ("g", "m", "c"):
            assert np.array_equal(getattr(alloc, k).numpy().astype(np.float32), batch.table.column(k).to_numpy()), k
        n += 1
    assert n == 2
    rec = res.records[0]
    assert rec["alloc/alloc_ratio_gap"] == 0.0  # the pre-pass reproduces the gradient pass under LoRA too
    assert rec["actor/kl"] > 0  # the adapter moved away from the base after the first update


def test_reference_scope_is_the_base_or_the_initial_adapter(tmp_path):
    from icsd_audit.train.models import lora as lo
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    plain = _logits(tiny_random_causal_lm(seed=3)[0], ids)
    model = lo.add_adapter(tiny_random_causal_lm(seed=3)[0], lo.LoraSettings(rank=2, alpha=4.0, targets="all-linear"))
    assert torch.equal(_logits(model, ids), plain)  # B = 0: a fresh adapter is the base exactly
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    adapted = _logits(model, ids)
    assert not torch.allclose(adapted, plain)
    with lo.reference_scope(model, False) as m:
        assert torch.equal(_logits(m, ids), plain)  # adapter off: the base's own forward
    assert torch.equal(_logits(model, ids), adapted)
    # a warm start: the trained adapter continues, a frozen copy of it is the reference
    model.save_pretrained(str(tmp_path / "a"))
    warm = lo.load_adapter(tiny_random_causal_lm(seed=3)[0], tmp_path / "a", trainable=True,
                           reference_from=tmp_path / "a")
    with torch.no_grad():
        for n, p in warm.named_parameters():
            if "lora_A.default" in n:
                p.add_(0.3)
    moved = _logits(warm, ids)
    assert not torch.allclose(moved, adapted)
    with lo.reference_scope(warm, True) as m:
        assert torch.allclose(_logits(m, ids), adapted, atol=1e-6)
    assert torch.equal(_logits(warm, ids), moved)
    train_names = {n for n, p in warm.named_parameters() if p.requires_grad}
    assert train_names and all(".default." in n for n in train_names)  # the reference copy stays frozen


def test_resume_of_a_lora_run_repeats_the_next_step(tmp_path, bank):
    from icsd_audit.train.loop import train

    straight = train(tiny_cfg(tmp_path / "a", bank, lora_rank=4, total_steps=2), env_factory=varied_factory())
    train(tiny_cfg(tmp_path / "b", bank, lora_rank=4, total_steps=1, checkpoint_every=1), env_factory=varied_factory())
    resumed = train(tiny_cfg(tmp_path / "b", bank, lora_rank=4, total_steps=2, checkpoint_every=1), resume=True,
                    env_factory=varied_factory())

    def strip(rec):
        return {k: v for k, v in rec.items() if not k.startswith("time/")}

    assert strip(resumed.records[0]) == strip(straight.records[1])


def test_init_from_an_adapter_or_a_full_model(tmp_path, bank):
    from icsd_audit.train.models import lora as lo
    from icsd_audit.train.config import ConfigError
    from icsd_audit.train.loop import train
    from icsd_audit.train.setup import build_models
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    first = train(tiny_cfg(tmp_path / "sft", bank, lora_rank=4, lr=0.05, checkpoint_every=1),
                  env_factory=varied_factory())
    adapter = first.checkpoint
    ids = torch.tensor([[1, 50, 51, 52, 53]])
    expect = _logits(lo.load_adapter(tiny_random_causal_lm(seed=0)[0], adapter, trainable=False), ids)
    assert not torch.allclose(expect, _logits(tiny_random_causal_lm(seed=0)[0], ids))
    cfg = tiny_cfg(tmp_path / "warm", bank, init=str(adapter)).validate()
    assert cfg.lora_enabled
    m = build_models(cfg, device=torch.device("cpu"), ckpt=None, precision="float32")
    assert torch.equal(_logits(m.policy, ids), expect)  # training starts from the adapter
    with lo.reference_scope(m.policy, True) as ref:
        assert torch.equal(_logits(ref, ids), expect)  # and the KL pulls towards it, not towards the base
    assert m.info["lora"]["rank"] == 4 and m.info["init"] == str(adapter)
    with pytest.raises(ConfigError, match="rank-4 adapter"):
        tiny_cfg(tmp_path / "x", bank, init=str(adapter), lora_rank=8).validate()
    with pytest.raises(lo.AdapterError, match="trained over base 'tiny-random'"):
        build_models(tiny_cfg(tmp_path / "y", bank, init=str(adapter), model="embedded"), device=torch.device("cpu"),
                ckpt=None, precision="float32")
    # a full model folder: it replaces model
    full, tok = tiny_random_causal_lm(seed=5)
    full.save_pretrained(tmp_path / "full")
    tok.save_pretrained(tmp_path / "full")
    m2 = build_models(tiny_cfg(tmp_path / "z", bank, init=str(tmp_path / "full")).validate(), device=torch.device("cpu"),
                 ckpt=None, precision="float32")
    assert torch.equal(_logits(m2.policy, ids), _logits(full, ids))
    with pytest.raises(ConfigError, match="neither a LoRA adapter folder"):
        tiny_cfg(tmp_path / "w", bank, init=str(tmp_path)).validate()


def test_eval_with_adapter_and_merged_export(tmp_path, bank):
    from icsd_audit.train.models import lora as lo
    from icsd_audit.train.loop import train
    from icsd_audit.train.models.loading import load_model, tiny_random_causal_lm

    res = train(tiny_cfg(tmp_path / "run", bank, lora_rank=4, lr=0.05, checkpoint_every=1),
                env_factory=varied_factory())
    adapter = res.checkpoint
    r = _icsd("eval", "--model", "tiny-random", "--adapter", str(adapter), "--tasks", "2", "--max-turns", "1",
              "--set", "max_response_tokens=4", "--set", "one_shot=false")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["adapter"] == str(adapter) and d["n_tasks"] == 2 and d["model"] == "tiny-random"
    out = tmp_path / "merged"
    e = _icsd("export", "--adapter", str(adapter), "--out", str(out))
    assert e.returncode == 0, e.stderr[-2000:]
    ids = torch.tensor([[1, 60, 61, 62]])
    want = _logits(lo.load_adapter(tiny_random_causal_lm(seed=0)[0], adapter, trainable=False), ids)
    merged = load_model(str(out)).model
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_logits(merged, ids), want, atol=1e-5)
    # an output never replaces an input, nor an existing folder
    for bad in (adapter, out, adapter / "sub"):
        b = _icsd("export", "--adapter", str(adapter), "--out", str(bad))
        assert b.returncode == 2 and len(b.stderr.strip().splitlines()) == 1, b.stderr
    assert (adapter / "adapter_model.safetensors").is_file()
