"""``--model tiny-word``: a word-level tokenizer over the clue environment's words and a tiny random Llama.

:func:`word_tokenizer` builds a ``transformers.PreTrainedTokenizerFast`` from a
``tokenizers`` WordLevel model in memory (lower-casing, ``\\w+|[^\\w\\s]+`` pre-
tokenization, words joined by one space on decoding), whose vocabulary is
:data:`icsd_audit.envs.clue.vocab.WORDS` after ``<pad>``, ``<eos>`` and ``<unk>``. Its chat
template writes the messages' contents one after another and ``>`` as the generation
prompt, so the trainer's prompt builder renders clue prompts without any word outside
the vocabulary. :func:`tiny_word_causal_lm` is a randomly initialised
``LlamaForCausalLM`` of that vocabulary (by default 3 layers of width 96: about 0.28 M
parameters), deterministic in its seed. Nothing is read from disk or downloaded; both
round-trip through ``save_pretrained`` and the loader of a model folder.
"""

from __future__ import annotations

from typing import Any

import torch

from icsd_audit.envs.clue.vocab import EOS, GEN_PROMPT, PAD, SPECIAL_TOKENS, UNK, WORDS

__all__ = ["TINY_WORD", "WORD_CHAT_TEMPLATE", "word_tokenizer", "tiny_word_causal_lm"]

#: The model name that selects these (``--model tiny-word``).
TINY_WORD = "tiny-word"

#: Contents joined by spaces, then the generation prompt ``>``: no role headers (they are not words).
WORD_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}{{ '" + GEN_PROMPT + "' }}{% endif %}"
)


def word_tokenizer() -> Any:
    """The word-level tokenizer (see the module docstring); unknown words become ``<unk>``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate((*SPECIAL_TOKENS, *WORDS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    tok.chat_template = WORD_CHAT_TEMPLATE
    return tok


def tiny_word_causal_lm(seed: int = 0, *, hidden_size: int = 96, num_layers: int = 3, num_heads: int = 4,
                        intermediate_size: int | None = None, max_position_embeddings: int = 256,
                        initializer_range: float = 0.1, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """A random ``LlamaForCausalLM`` over :func:`word_tokenizer`'s vocabulary, and that tokenizer.

    Initialisation is deterministic in ``seed`` and leaves the global RNG alone.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = word_tokenizer()
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must divide by num_heads={num_heads}")
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True, initializer_range=initializer_range,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(dtype).eval()
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.bos_token_id = None
    return model, tok
