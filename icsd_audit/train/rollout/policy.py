"""Who writes the replies of a rollout: the model, an environment's expert, or a script.

:func:`icsd_audit.train.rollout.collect.collect_rollouts` asks a :class:`TurnPolicy` for the
replies of every running episode at each turn and plays them through the same prompt
builder, reply parser, validity rule, reward shaping and invalid-turn penalty whoever
wrote them, so an expert's rollout checks the environment's rules exactly as a model's
rollout meets them.

* :class:`ModelPolicy`: batched sampling from the language model (the default).
* :class:`ExpertPolicy`: each environment's expert (:mod:`icsd_audit.envs.expert`),
  which reads the episode's privileged state; ``icsd eval --policy expert`` and
  ``icsd train --policy expert``.
* :class:`ScriptedPolicy`: replies from a function of the turn (tests, malformed-reply
  catalogues).

A text policy's reply tokens are the reply's ids followed by the end-of-turn token, as a
model's sampled reply ends. :func:`expert_turns` collects expert rollouts as supervised
pairs: the student prompt of each turn (ids and text, rendered by the trainer's own
:class:`~icsd_audit.train.rollout.collect.PromptBuilder`) and the expert's reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor

from icsd_audit.envs import Observation, TextEnv
from icsd_audit.train.rollout.prompts import TurnContext

__all__ = ["POLICIES", "PolicyTurn", "PolicyReply", "TurnPolicy", "ModelPolicy", "ExpertPolicy", "ScriptedPolicy",
           "ExpertTurn", "policy_tokenizer"]

#: Names accepted by ``--policy`` / the config's ``policy``.
POLICIES = ("model", "expert")


@dataclass(frozen=True)
class PolicyTurn:
    """One running episode's turn, as a policy sees it."""

    env: TextEnv  # the episode's environment (an expert reads its privileged state)
    observation: Observation
    ctx: TurnContext
    prompt_ids: list[int]
    episode: int = -1  # the trajectory's index in the rollout (slot * group_size + rollout)


@dataclass(frozen=True)
class PolicyReply:
    response_ids: list[int]  # through the end-of-turn token
    text: str  # what the reply parser reads (special tokens dropped)
    logp: Tensor | None  # log-probs of response_ids under the sampler (None: not a sampled reply)


class TurnPolicy(Protocol):
    """Replies for a batch of turns, in order."""

    name: str

    def reply(self, turns: Sequence[PolicyTurn]) -> list[PolicyReply]: ...


class ModelPolicy:
    """Batched ``generate`` from the language model (:func:`icsd_audit.train.rollout.sampling.sample`)."""

    name = "model"

    def __init__(self, model: Any, tokenizer: Any, *, max_response_tokens: int, temperature: float, device: torch.device,
                 precision: str = "float32", record_logp: bool = True):
        from icsd_audit.train.rollout.sampling import pad_and_stop_ids

        self.model, self.tok = model, tokenizer
        self.max_response_tokens, self.temperature = max_response_tokens, temperature
        self.device, self.precision, self.record_logp = device, precision, record_logp
        self.pad_id, self.stop_ids = pad_and_stop_ids(model, tokenizer)

    def reply(self, turns: Sequence[PolicyTurn]) -> list[PolicyReply]:
        from icsd_audit.train.rollout.sampling import sample

        resp, logps = sample(self.model, [t.prompt_ids for t in turns], max_new_tokens=self.max_response_tokens,
                             temperature=self.temperature, pad_id=self.pad_id, stop_ids=self.stop_ids,
                             device=self.device, precision=self.precision, want_logp=self.record_logp)
        return [PolicyReply(response_ids=r, text=self.tok.decode(r, skip_special_tokens=True), logp=lp)
                for r, lp in zip(resp, logps)]


class ScriptedPolicy:
    """Replies from ``script(turn) -> text`` (e.g. a catalogue of malformed replies).

    A reply's tokens are the text's ids followed by the end-of-turn token, as a model's
    sampled reply ends.
    """

    name = "scripted"

    def __init__(self, tokenizer: Any, script: Callable[[PolicyTurn], str]):
        self.tok, self.script = tokenizer, script
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        if eos is None:
            raise ValueError("the tokenizer has no EOS token to end a reply with")
        self.eos = int(eos)

    def reply(self, turns: Sequence[PolicyTurn]) -> list[PolicyReply]:
        out = []
        for t in turns:
            text = self.script(t)
            ids = list(self.tok(text, add_special_tokens=False).input_ids) + [self.eos]
            out.append(PolicyReply(response_ids=ids, text=text, logp=None))
        return out


def _expert_text(turn: PolicyTurn) -> str:
    from icsd_audit.envs.expert import expert_reply

    return expert_reply(turn.env)


class ExpertPolicy(ScriptedPolicy):
    """Each environment's expert (:func:`icsd_audit.envs.expert.expert_reply`)."""

    name = "expert"

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer, _expert_text)


@dataclass(frozen=True)
class ExpertTurn:
    """One supervised pair: a turn's student prompt and the expert's reply to it."""

    task: int
    turn: int
    prompt_ids: list[int]
    prompt_text: str
    reply: str
    reply_ids: list[int]  # reply tokens through the end-of-turn token
    valid: bool
    won: bool  # the episode was won


def policy_tokenizer(model: str, *, seed: int = 0, trust_remote_code: bool = False) -> Any:
    """The tokenizer of ``model`` (a folder, 'embedded' or 'tiny-random'), without loading its weights."""
    from icsd_audit.train.models import loading as models

    if model == "tiny-random":
        return models._byte_level_tokenizer()
    if model == "tiny-word":
        from icsd_audit.train.models.tiny_word import word_tokenizer

        return word_tokenizer()
    if model in ("embedded", "default", "smollm2", "smollm2-135m-instruct"):
        folder, _ = models.ensure_embedded_model()
        return models.load_tokenizer(folder)
    return models.load_tokenizer(model, trust_remote_code=trust_remote_code)
