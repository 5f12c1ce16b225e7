"""``--model tiny-word``: a word-level tokenizer over the clue environment's words and a tiny random Llama.

:func:`word_tokenizer` builds a ``transformers.PreTrainedTokenizerFast`` from a
``tokenizers`` WordLevel model in memory (lower-casing, ``\\w+|[^\\w\\s]+`` pre-
tokenization, words joined by one space on decoding), whose vocabulary is
:data:`icsd_audit.envs.clue.vocab.WORDS` after ``<pad>``, ``<eos>`` and ``<unk>``. Its chat
template writes the messages' contents one after another and ``>`` as the generation
prompt, so the trainer's prompt builder renders clue prompts without any word outside
the vocabulary. :func:`tiny_word_causal_lm` is a randomly initialised
``LlamaForCausalLM`` of that vocabulary (by default 3 layers of width 96: about 0.28 M
parameters), deterministic in its seed. :func:`learn_to_read_the_clue` gives it the one
skill a pretrained model would bring to the privileged self-teacher: reading the clue
(``--model tiny-word`` is that random model after this lesson). Nothing is read from disk
or downloaded; both round-trip through ``save_pretrained`` and the loader of a model folder.
"""

from __future__ import annotations

from typing import Any

import torch

from icsd_audit.envs.clue.vocab import EOS, GEN_PROMPT, MAX_BOXES, PAD, SPECIAL_TOKENS, UNK, WORDS

__all__ = ["TINY_WORD", "WORD_CHAT_TEMPLATE", "READING_STEPS", "word_tokenizer", "tiny_word_causal_lm",
           "learn_to_read_the_clue", "clue_reading"]

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


#: Optimizer steps of :func:`learn_to_read_the_clue` (the lesson is learnt within about 50: loss 0.002).
READING_STEPS = 60


def learn_to_read_the_clue(model: Any, tok: Any, *, seed: int = 0, steps: int = READING_STEPS, rows: int = 64,
                           lr: float = 3e-3, history_window: int = 1) -> None:
    """Teach ``model`` (in place) to read the self-teacher's clue, and nothing about the task.

    The self-teacher is the policy with ``[Privileged Skill Information] clue key in box C`` in front of
    the student's prompt. A random model has never seen those words, and RL never shows them to it, so
    its teacher's preference would be noise whatever C is. This lesson stands in for the reading a
    pretrained model brings: on prompts of random valid play (any number of boxes 2 to 12, the key
    anywhere), half with the clue block in front and half without, it trains the box word after ``open``
    toward C with the block and toward the uniform distribution over the boxes without it (a student
    without the clue has no reason to prefer a box). The reply's first word is held where the random
    model has it (a KL term to the model before the lesson at that position), so the reply format is
    not taught: the student's replies stay almost all invalid.
    AdamW, ``steps`` steps of ``rows`` prompts; deterministic in ``seed``, the global RNGs untouched.
    """
    import random

    from icsd_audit.envs.clue import ClueEnv
    from icsd_audit.envs.clue.prompt import clue_prompt
    from icsd_audit.envs.clue.vocab import OPEN
    from icsd_audit.envs.base import HistoryEntry, skill_block

    rng = random.Random(seed)
    vocab = tok.get_vocab()
    open_id, box_ids = vocab[OPEN], [vocab[str(k)] for k in range(1, MAX_BOXES + 1)]
    envs: dict[int, Any] = {}

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False).input_ids)

    def example() -> tuple[list[int], list[int], int, int]:
        """(student prompt ids, clue block ids, the clue's box, boxes) of a random turn of random valid play."""
        boxes = rng.randint(2, MAX_BOXES)
        env = envs.setdefault(boxes, ClueEnv("train", boxes=boxes, max_steps=MAX_BOXES))
        obs = env.reset(rng.randrange(env.num_tasks))
        history: list[Any] = []
        for _ in range(rng.randrange(4)):
            action = f"{OPEN} {rng.randint(1, boxes)}"
            res = env.step(action)
            if res.done:  # found: a prompt never follows it
                break
            history.append(HistoryEntry(observation=obs.text, action=action, reply=action))
            obs = res.observation
        text = tok.apply_chat_template([{"role": "user", "content": clue_prompt(obs.instruction, obs.text, history,
                                                                                 history_window)}],
                                       tokenize=False, add_generation_prompt=True)
        clue = rng.randint(1, boxes)  # the lesson is about reading: any box the clue names
        return encode(text), encode(skill_block(f"clue key in box {clue}")), clue, boxes

    import copy

    before = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    with torch.random.fork_rng(devices=[]):
        for _ in range(steps):
            batch = [example() for _ in range(rows)]
            seqs = [(block + ids if i % 2 == 0 else ids) + [open_id] for i, (ids, block, _, _) in enumerate(batch)]
            width = max(len(x) for x in seqs)
            input_ids = torch.full((rows, width), tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros((rows, width), dtype=torch.long)
            for i, x in enumerate(seqs):
                input_ids[i, width - len(x):] = torch.as_tensor(x)
                mask[i, width - len(x):] = 1
            inputs = dict(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                          logits_to_keep=2, use_cache=False)
            logp = torch.log_softmax(model(**inputs).logits.float(), -1)  # (rows, 2, V): the reply's two words
            with torch.no_grad():
                first_before = torch.log_softmax(before(**inputs).logits[:, 0].float(), -1)
            losses = [-logp[i, 1, box_ids[clue - 1]] if i % 2 == 0 else -logp[i, 1, box_ids[:boxes]].mean()
                      for i, (_, _, clue, boxes) in enumerate(batch)]
            hold = torch.nn.functional.kl_div(logp[:, 0], first_before, log_target=True, reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            (torch.stack(losses).mean() + hold).backward()
            opt.step()
    model.eval()


def clue_reading(seed: int = 0, **options: Any) -> tuple[Any, Any]:
    """``--model tiny-word``: :func:`tiny_word_causal_lm` after :func:`learn_to_read_the_clue`."""
    model, tok = tiny_word_causal_lm(seed, **options)
    learn_to_read_the_clue(model, tok, seed=seed)
    return model, tok
