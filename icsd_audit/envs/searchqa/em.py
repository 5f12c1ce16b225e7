"""Exact match, as Search-R1 scores it (``verl/utils/reward_score/qa_em.py``, itself SQuAD's).

``normalize_answer``: lower-case, delete every ASCII punctuation character
(``string.punctuation``), replace the whole words ``a``, ``an``, ``the`` by a space,
collapse runs of whitespace. Nothing else: accents are kept (``Beyoncé`` does not match
``Beyonce``) and non-ASCII punctuation such as curly quotes or dashes is kept too, exactly
as in Search-R1, so EM here equals EM there on the same strings. A prediction scores 1
when its normalised form equals the normalised form of *any* gold answer.
"""

from __future__ import annotations

import re
import string
from typing import Iterable

__all__ = ["normalize_answer", "exact_match", "extract_answer"]

_PUNCT = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(text: str) -> str:
    """Search-R1's answer normalisation (see the module docstring)."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golden: str | Iterable[str]) -> bool:
    """Whether ``prediction`` equals any gold answer after :func:`normalize_answer`."""
    answers = [golden] if isinstance(golden, str) else list(golden)
    pred = normalize_answer(prediction)
    return any(normalize_answer(g) == pred for g in answers)


def extract_answer(text: str) -> str | None:
    """The stripped text of the first ``<answer>...</answer>`` block, or ``None``."""
    m = _ANSWER.search(text)
    return None if m is None else m.group(1).strip()
