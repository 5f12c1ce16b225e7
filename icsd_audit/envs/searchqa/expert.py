"""The Search-QA expert: the question's oracle search chain, then the gold answer, in Search-R1's tags.

For a built-in question (:class:`~.kb.QAItem` with ``hops``) the expert searches each
hop's oracle query (the hop entity's name, whose passage states the fact the next hop
needs; every one is in BM25's top 3, ``tests/envs/test_searchqa.py``), then answers with
the first gold answer. The last turn of the budget is the final-answer turn, so with
``max_steps`` = T it searches at most T - 1 hops and answers at turn T at the latest
(a 4-hop question under Table A1's 4 turns skips its last search). It counts the searches
actually run, so after someone else's invalid turn it resumes the chain where it stopped. A user question has
no oracle chain: the expert searches the question once, then answers.

Replies are ``<think>...</think><search> q </search>`` or ``<think>...</think><answer> a </answer>``,
valid under both protocols (:mod:`.protocol`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["expert_reply"]


def expert_reply(env: Any) -> str:
    """The expert's reply for ``env``'s current turn (``env``: a :class:`~.env.SearchQAEnv` mid-episode)."""
    item = env.item
    if item is None:
        raise RuntimeError("no running episode; call reset() first")
    queries = [q for q, _ in item.hops] if item.hops else [item.question]
    turns_left = env.max_steps - env.steps  # this turn included; the last one is the final-answer turn
    if env.searches < len(queries) and turns_left > 1:
        q = queries[env.searches]
        why = ("I do not know this, so I search for it." if not item.hops else
               f"I need the facts about {q} to go on, so I search for it.")
        return f"<think>{why}</think><search> {q} </search>"
    answer = item.golden_answers[0]
    return f"<think>The information I found gives the answer: {answer}.</think><answer> {answer} </answer>"
