"""Rollout sampling: one reply per prompt from plain softmax(logits / temperature) with HF ``generate``.

Shared by the built-in multi-turn rollout (:mod:`icsd_audit.train.rollout.collect`), evaluation
and the TRL engine's episode rollout (:mod:`icsd_audit.integrations.trl.rollout`): batched
``generate`` with a KV cache and left padding; the log-probs of the sampled tokens are
read from the raw logits divided by the temperature, so they are log pi of the sampled
tokens up to kernel numerics.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import numpy as np

import torch
from torch import Tensor

from icsd_audit.train.update.logprobs import autocast_for

__all__ = ["pad_and_stop_ids", "sample", "sampling_config", "seed_step", "draw_tasks"]


def _stop_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if src is None:
            continue
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("the tokenizer has no EOS token; set tokenizer.eos_token to the chat template's end-of-turn token")
    return ids


def pad_and_stop_ids(model: Any, tokenizer: Any) -> tuple[int, list[int]]:
    """(padding id, stop ids) of sampling: the tokenizer's pad token, else the first stop id."""
    stop_ids = _stop_ids(model, tokenizer)
    return (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]), stop_ids


def sampling_config(*, max_new_tokens: int, temperature: float, pad_id: int, stop_ids: Sequence[int],
                    want_logits: bool = True) -> Any:
    """The ``GenerationConfig`` of rollouts: plain sampling from softmax(logits / temperature).

    Every logits processor is set to its neutral value explicitly: ``generate`` fills
    fields left at None from the model's own generation_config (Qwen2.5-Instruct ships
    top_k=20, top_p=0.8, repetition_penalty=1.05), which would make the sampler's
    distribution differ from the policy we train. ``temperature <= 0`` is greedy.
    """
    from transformers import GenerationConfig

    greedy = temperature <= 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        num_beams=1,
        temperature=1.0 if greedy else float(temperature),
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
        guidance_scale=1.0,
        renormalize_logits=False,
        pad_token_id=pad_id,
        eos_token_id=list(stop_ids),
        output_logits=want_logits,
        return_dict_in_generate=True,
    )


@torch.no_grad()
def sample(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    pad_id: int,
    stop_ids: Sequence[int],
    device: torch.device,
    precision: str = "float32",
    want_logp: bool = True,
) -> tuple[list[list[int]], list[Tensor | None]]:
    """Sample one reply per prompt with HF ``generate``; return ids (through the stop token) and their log-probs."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    att = torch.zeros((B, P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        att[i, P - len(p):] = 1
    greedy = temperature <= 0
    gc = sampling_config(max_new_tokens=max_new_tokens, temperature=temperature, pad_id=pad_id, stop_ids=stop_ids,
                         want_logits=want_logp)
    with autocast_for(device, precision):
        out = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), generation_config=gc)
    gen = out.sequences[:, P:].cpu()
    stops = torch.as_tensor(list(stop_ids))
    is_stop = torch.isin(gen, stops)
    S = gen.shape[1]
    first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.full((B,), S))
    lengths = first.tolist()
    logps: list[Tensor | None] = [None] * B
    if want_logp:
        logits = torch.stack(out.logits, dim=1).float()  # (B, S, V) raw logits
        if not greedy and temperature != 1.0:
            logits = logits / temperature
        lp = (logits.gather(-1, gen.to(logits.device).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)).cpu()
        logps = [lp[i, : lengths[i]].clone() for i in range(B)]
    return [gen[i, : lengths[i]].tolist() for i in range(B)], logps


def seed_step(seed: int, step: int) -> None:
    """Reseed Python, NumPy and torch (CPU and CUDA) from (seed, step)."""
    s = (int(seed) * 1_000_003 + int(step) * 7919 + 17) % (2**31 - 1)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def draw_tasks(seed: int, step: int, num_tasks: int, n: int) -> list[int]:
    """The step's task indices: distinct when the split has enough tasks."""
    rng = np.random.default_rng([int(seed), int(step)])
    return [int(t) for t in rng.choice(num_tasks, size=n, replace=n > num_tasks)]
