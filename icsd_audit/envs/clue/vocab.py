"""The clue environment's words: every text its prompts, observations, clues and replies use.

The tiny word-level model (:mod:`icsd_audit.train.models.tiny_word`) has exactly these tokens,
so anything the environment or the trainer's prompt builder writes for ``--env clue``
must be made of them (tests/envs/test_clue.py tokenizes every prompt and checks that no
word falls back to the unknown token). Punctuation is split off words by the
tokenizer's pre-tokenizer (``\\w+|[^\\w\\s]+``), so ``[`` and ``]`` of the teacher's
``[Privileged Skill Information]`` header are words of their own.
"""

from __future__ import annotations

__all__ = ["SPECIAL_TOKENS", "PAD", "EOS", "UNK", "MAX_BOXES", "WORDS", "OPEN", "LEFT", "RIGHT", "FOUND", "INVALID",
           "START", "GEN_PROMPT"]

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
#: Special tokens, in id order (0, 1, 2).
SPECIAL_TOKENS = (PAD, EOS, UNK)
#: The largest number of boxes a task may have: box numbers 1..MAX_BOXES are words.
MAX_BOXES = 12

OPEN, LEFT, RIGHT, FOUND, INVALID, START = "open", "left", "right", "found", "invalid", "start"
#: What the chat template appends after the prompt: the reply starts right after it.
GEN_PROMPT = ">"

#: Every ordinary word, in id order after the special tokens (lower case: the tokenizer lower-cases its input).
WORDS: tuple[str, ...] = (
    # the prompt and the feedback
    "boxes", "to", ".", GEN_PROMPT, OPEN, START, LEFT, RIGHT, FOUND, INVALID,
    # the clue and SDAR's privileged header ("[Privileged Skill Information]")
    "clue", "key", "in", "box", "[", "]", "privileged", "skill", "information",
    # box numbers
    *(str(k) for k in range(1, MAX_BOXES + 1)),
)
