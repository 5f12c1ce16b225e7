"""SkillBank: privileged skill text for the self-teacher, retrieved by keyword match on the task.

A SkillBank is a JSON file (format ``icsd-skillbank``, version 1; docs/skills.md) holding
general skills, which every retrieval returns, and task categories, each with keywords
matched against the task instruction and a list of short strategy skills. The retrieved
text ``z`` is what the privileged teacher sees prepended to its prompt (SDAR's
"[Privileged Skill Information]" block; see ``icsd_audit.train.rollout.prompts``).

Two retrieval rules (the trainer's ``skill_match``):

* ``sdar`` (default, the paper's setting), :meth:`SkillBank.retrieve_sdar`: SDAR's
  ``SkillProvider.get_privileged_info_from_prompt`` (``verl/trainer/ppo/rlsd_utils.py``):
  the turn's *whole student prompt* is lower-cased; a category matches when *any* of its
  keywords occurs in it as a plain substring (``kw in text``); ``z`` is the general block
  followed by the block of every matched category, joined by a blank line; with no match,
  ``z`` is the general block alone.
* ``instruction`` (this toolkit's option), :meth:`SkillBank.retrieve`: keywords are
  matched on the task instruction only, with the bank's own settings: a bank may ask for
  whole-word matching (``"match": "word"``, plural ``s``/``es`` allowed), which the shipped
  banks do so that "hat" does not fire on "that" nor "hair" on "chair".

The paper uses SDAR's SkillBank: load SDAR's ``skills/<env>`` folder (through
:func:`import_sdar`, e.g. ``skillbank=/path/to/SDAR/skills/webshop``). The shipped banks
are written here, not SDAR's. A keyword may
also be a list of words that must *all* occur. ``"select": "first"`` keeps only the first
matched category (ALFWorld's task types are exclusive). A category may carry ``keys``
(an ALFWorld task type, a Search-QA data source) for an exact lookup, as SDAR does with
game files and data sources.

:func:`import_sdar` reads SDAR's skills folder layout: ``skill_mapping.json`` with
``skill_files`` (skill name -> markdown file), ``task_to_skill`` (task type -> skill
name) and optional ``task_keywords`` (task type -> keywords), plus the markdown files,
and produces a bank whose retrieval reproduces SDAR's text exactly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "SDAR_SEARCH_ROUTES",
    "sdar_search_task",
    "BUILTIN_BANKS",
    "FORMAT",
    "FORMAT_VERSION",
    "Category",
    "Retrieved",
    "Skill",
    "SkillBank",
    "SkillBankError",
    "builtin_bank_path",
    "import_sdar",
    "load_skillbank",
]

FORMAT = "icsd-skillbank"
FORMAT_VERSION = 1
#: Banks shipped in ``icsd_audit/skills/``, one per built-in environment.
BUILTIN_BANKS = ("webshop", "alfworld", "searchqa")

MatchMode = Literal["substring", "word"]
SelectMode = Literal["all", "first"]
Keyword = str | tuple[str, ...]


class SkillBankError(ValueError):
    """A SkillBank file is malformed; the message names the field and how to fix it."""


@dataclass(frozen=True)
class Skill:
    """One strategy: a short imperative text, optionally with a title."""

    id: str
    text: str
    title: str = ""

    def render(self) -> str:
        return f"{self.title}: {self.text}" if self.title else self.text


@dataclass(frozen=True)
class Category:
    """A task category: how to recognise it and the skills that help with it."""

    name: str
    skills: tuple[Skill, ...] = ()
    #: Keywords matched against the task text; a tuple means all of its words must occur.
    keywords: tuple[Keyword, ...] = ()
    #: Exact identifiers (task types, data sources) for :meth:`SkillBank.retrieve` ``key=``.
    keys: tuple[str, ...] = ()
    #: Heading of the rendered block (default: ``TASK: <name>``).
    title: str = ""
    #: A verbatim block used instead of rendering ``skills`` (imported SDAR markdown).
    text: str | None = None

    def render(self, default_title: str) -> str:
        if self.text is not None:
            return self.text.strip()
        if not self.skills:
            return ""
        head = f"### {self.title or default_title} ###"
        lines = [f"{i}. {s.render()}" for i, s in enumerate(self.skills, 1)]
        return head + "\n" + "\n".join(lines)


@dataclass(frozen=True)
class Retrieved:
    """The privileged text ``z`` for one task and where it came from."""

    text: str
    #: Matched categories, in the order their blocks appear in ``text``.
    categories: tuple[str, ...]
    #: Ids of the skills whose text is in ``z`` (empty for verbatim blocks).
    skill_ids: tuple[str, ...]
    #: ``"keyword"``, ``"key"``, ``"fallback"``, ``"general"`` or ``"all"``.
    how: str


def _norm_kw(kw: Any, where: str) -> Keyword:
    if isinstance(kw, str):
        k = kw.strip().lower()
        if not k:
            raise SkillBankError(f"{where}: empty keyword; remove it")
        return k
    if isinstance(kw, (list, tuple)) and kw and all(isinstance(w, str) and w.strip() for w in kw):
        return tuple(w.strip().lower() for w in kw)
    raise SkillBankError(f"{where}: a keyword must be a string or a non-empty list of strings, got {kw!r}")


@dataclass
class SkillBank:
    """General skills plus keyword-matched task categories. See the module docstring."""

    env: str
    general: Category
    categories: list[Category] = field(default_factory=list)
    match: MatchMode = "substring"
    select: SelectMode = "all"
    #: Category used when nothing matches (``None``: general skills only, as SDAR).
    fallback: str | None = None
    description: str = ""
    #: Provenance written into the file (e.g. the SDAR folder a bank was imported from).
    source: str = ""
    #: Where this bank was loaded from (not written into the file).
    path: str = field(default="", compare=False)
    #: Category names in SDAR's ``task_keywords`` order (set by :func:`import_sdar`, not
    #: written into the file): :meth:`retrieve_sdar` concatenates matches in this order, as
    #: SDAR does; empty means bank order.
    sdar_order: tuple[str, ...] = field(default=(), compare=False)
    _patterns: dict[str, re.Pattern[str]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---------------------------------------------------------------- validation / IO

    def validate(self) -> None:
        if self.match not in ("substring", "word"):
            raise SkillBankError(f"match must be 'substring' or 'word', got {self.match!r}")
        if self.select not in ("all", "first"):
            raise SkillBankError(f"select must be 'all' or 'first', got {self.select!r}")
        names = [c.name for c in self.categories]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SkillBankError(f"duplicate category names {dupes}; give each category a unique name")
        if self.fallback is not None and self.fallback not in names:
            raise SkillBankError(f"fallback {self.fallback!r} is not a category; use one of {names} or null")
        ids = [s.id for c in [self.general, *self.categories] for s in c.skills]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise SkillBankError(f"duplicate skill ids {dupes}; skill ids must be unique in a bank")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, path: str = "") -> SkillBank:
        """Build a bank from the parsed JSON (see docs/skills.md for the format)."""
        if data.get("format") != FORMAT:
            raise SkillBankError(
                f"not a SkillBank file (format={data.get('format')!r}, expected {FORMAT!r}); "
                "for SDAR's skills folder use import_sdar() / load_skillbank(folder)"
            )
        if data.get("version") != FORMAT_VERSION:
            raise SkillBankError(f"unsupported SkillBank version {data.get('version')!r}; this icsd reads version 1")

        def skills_of(block: Mapping[str, Any], where: str) -> tuple[Skill, ...]:
            out = []
            for j, s in enumerate(block.get("skills", []) or []):
                if isinstance(s, str):
                    out.append(Skill(id=f"{where}.{j + 1}", text=s.strip()))
                elif isinstance(s, Mapping) and isinstance(s.get("text"), str) and s["text"].strip():
                    out.append(
                        Skill(
                            id=str(s.get("id") or f"{where}.{j + 1}"),
                            text=s["text"].strip(),
                            title=str(s.get("title", "")).strip(),
                        )
                    )
                else:
                    raise SkillBankError(f"{where}.skills[{j}] must be a string or an object with a non-empty 'text'")
            return tuple(out)

        def category(block: Mapping[str, Any], where: str, name: str) -> Category:
            if not isinstance(block, Mapping):
                raise SkillBankError(f"{where} must be an object")
            text = block.get("text")
            if text is not None and not isinstance(text, str):
                raise SkillBankError(f"{where}.text must be a string or null")
            return Category(
                name=name,
                skills=skills_of(block, name),
                keywords=tuple(_norm_kw(k, f"{where}.keywords") for k in block.get("keywords", []) or []),
                keys=tuple(str(k) for k in block.get("keys", []) or []),
                title=str(block.get("title", "") or ""),
                text=text,
            )

        general = category(data.get("general", {}) or {}, "general", "general")
        cats_raw = data.get("categories", [])
        if not isinstance(cats_raw, list):
            raise SkillBankError("categories must be a list of objects, each with a 'name'")
        cats = []
        for i, c in enumerate(cats_raw):
            if not isinstance(c, Mapping) or not isinstance(c.get("name"), str) or not c["name"].strip():
                raise SkillBankError(f"categories[{i}] needs a non-empty 'name'")
            cats.append(category(c, f"categories[{i}]", c["name"].strip()))
        return cls(
            env=str(data.get("env", "")),
            general=general,
            categories=cats,
            match=data.get("match", "substring"),
            select=data.get("select", "all"),
            fallback=data.get("fallback"),
            description=str(data.get("description", "")),
            source=str(data.get("source", "")),
            path=path,
        )

    def to_dict(self) -> dict[str, Any]:
        def block(c: Category) -> dict[str, Any]:
            out: dict[str, Any] = {}
            if c.title:
                out["title"] = c.title
            if c.keywords:
                out["keywords"] = [list(k) if isinstance(k, tuple) else k for k in c.keywords]
            if c.keys:
                out["keys"] = list(c.keys)
            if c.text is not None:
                out["text"] = c.text
            if c.skills:
                out["skills"] = [
                    {"id": s.id, **({"title": s.title} if s.title else {}), "text": s.text} for s in c.skills
                ]
            return out

        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "env": self.env,
            "description": self.description,
            **({"source": self.source} if self.source else {}),
            "match": self.match,
            "select": self.select,
            "fallback": self.fallback,
            "general": block(self.general),
            "categories": [{"name": c.name, **block(c)} for c in self.categories],
        }

    def save(self, path: str | Path) -> Path:
        """Write the bank as JSON (UTF-8, indented, trailing newline)."""
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return p

    # ---------------------------------------------------------------- retrieval

    def category(self, name: str) -> Category:
        for c in self.categories:
            if c.name == name:
                return c
        raise KeyError(
            f"no category {name!r} in the {self.env or 'unnamed'} bank; have {[c.name for c in self.categories]}"
        )

    def _word_pattern(self, word: str) -> re.Pattern[str]:
        pat = self._patterns.get(word)
        if pat is None:
            pat = re.compile(r"(?<![a-z0-9])" + re.escape(word) + r"(?:s|es)?(?![a-z0-9])")
            self._patterns[word] = pat
        return pat

    def _has(self, text: str, word: str, match: MatchMode | None = None) -> bool:
        if (match or self.match) == "substring":
            return word in text
        return self._word_pattern(word).search(text) is not None

    def matches(self, category: Category, task: str, *, match: MatchMode | None = None) -> bool:
        """Does any keyword of ``category`` occur in ``task`` (lower-cased)? ``match`` overrides the bank's."""
        text = task.lower()
        for kw in category.keywords:
            if isinstance(kw, tuple):
                if all(self._has(text, w, match) for w in kw):
                    return True
            elif self._has(text, kw, match):
                return True
        return False

    def matched_categories(self, task: str) -> list[Category]:
        found = [c for c in self.categories if c.keywords and self.matches(c, task)]
        return found[:1] if self.select == "first" else found

    def retrieve_sdar(self, prompt_text: str, *, key: str | None = None) -> Retrieved:
        """SDAR's keyword-matching retrieval (``SkillProvider.get_privileged_info_from_prompt``).

        ``prompt_text`` is the whole student prompt of the turn (SDAR matches the decoded
        prompt, so the observation, the admissible actions and the history can trigger a
        category, not only the instruction). Lower-cased; a category matches when *any*
        keyword is a plain substring (a keyword list: all of its words); *every* matching
        category is kept, in bank order; with none, the general block alone. The bank's own
        ``match``, ``select`` and ``fallback`` settings are ignored here: they belong to
        :meth:`retrieve`. ``key`` (an ALFWorld game file, a Search-QA data source) takes
        precedence as in SDAR's ``get_privileged_info`` / ``..._from_data_source``.
        """
        if key:
            c = self._key_category(key)
            if c is None:  # a Search-QA data source against task-type keys: SDAR's routing
                routed = sdar_search_task(key, prompt_text)
                c = next((x for x in self.categories if routed is not None and routed in x.keys), None)
            if c is not None:
                return self._assemble([c], "key")
        cats = [c for c in self.categories if c.keywords and self.matches(c, prompt_text, match="substring")]
        if self.sdar_order:
            rank = {name: i for i, name in enumerate(self.sdar_order)}
            cats.sort(key=lambda c: rank.get(c.name, len(rank)))
        return self._assemble(cats, "keyword") if cats else self._assemble((), "general")

    def _key_category(self, key: str) -> Category | None:
        for c in self.categories:  # exact identifier first
            if key in c.keys:
                return c
        for c in self.categories:  # then as a substring (a game file path holding the task type)
            if any(k and k in key for k in c.keys):
                return c
        return None

    def _assemble(self, cats: Sequence[Category], how: str) -> Retrieved:
        blocks, ids, names = [], [], []
        seen_text: set[str] = set()
        for c in [self.general, *cats]:
            b = c.render("GENERAL SKILLS" if c is self.general else f"TASK: {c.name}")
            if c is not self.general:
                names.append(c.name)
            if b and b not in seen_text:
                blocks.append(b)
                seen_text.add(b)
                if c.text is None:
                    ids.extend(s.id for s in c.skills)
        return Retrieved(text="\n\n".join(blocks), categories=tuple(names), skill_ids=tuple(ids), how=how)

    def retrieve(
        self, task: str, *, key: str | None = None, mode: Literal["match", "all", "general"] = "match"
    ) -> Retrieved:
        """The privileged skill text ``z`` for a task instruction.

        Args:
            task: the task instruction (the keywords are matched against it).
            key: an identifier such as an ALFWorld game-file path or a Search-QA data
                source; a category whose ``keys`` equal it (or occur in it) is used alone,
                as SDAR does; when none does, keyword matching on ``task`` decides.
            mode: ``"match"`` (default), ``"all"`` (general + every category, SDAR's
                ``skill_all``) or ``"general"`` (general skills only).
        """
        if mode == "all":
            return self._assemble(self.categories, "all")
        if mode == "general":
            return self._assemble((), "general")
        if mode != "match":
            raise ValueError(f"mode must be 'match', 'all' or 'general', got {mode!r}")
        if key:
            c = self._key_category(key)
            if c is None:  # a Search-QA data source against task-type keys: SDAR's routing
                routed = sdar_search_task(key, task)
                c = next((x for x in self.categories if routed is not None and routed in x.keys), None)
            if c is not None:
                return self._assemble([c], "key")
        cats = self.matched_categories(task)
        if cats:
            return self._assemble(cats, "keyword")
        if self.fallback is not None:
            return self._assemble([self.category(self.fallback)], "fallback")
        return self._assemble((), "general")


# ------------------------------------------------------------------------------------- loading


def builtin_bank_path(name: str) -> Path:
    """Path of a shipped bank (``webshop``, ``alfworld``, ``searchqa``)."""
    key = name.strip().lower()
    if key not in BUILTIN_BANKS:
        raise SkillBankError(f"no built-in SkillBank {name!r}; built-in banks: {list(BUILTIN_BANKS)}")
    return Path(str(resources.files("icsd_audit").joinpath("skills", f"{key}.json")))


def load_skillbank(path_or_name: str | Path) -> SkillBank:
    """Load a bank by built-in name, from an icsd JSON file, or from an SDAR skills folder.

    An SDAR folder (one holding ``skill_mapping.json``), or that file itself, goes through
    :func:`import_sdar`.
    """
    if isinstance(path_or_name, str) and path_or_name.strip().lower() in BUILTIN_BANKS:
        p = builtin_bank_path(path_or_name)
    else:
        p = Path(path_or_name).expanduser()
    if p.is_dir() or p.name == "skill_mapping.json":
        return import_sdar(p)
    if not p.is_file():
        raise SkillBankError(
            f"SkillBank {str(path_or_name)!r} not found: give a built-in name {list(BUILTIN_BANKS)}, "
            "a SkillBank JSON file, or an SDAR skills folder holding skill_mapping.json"
        )
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise SkillBankError(f"{p} is not valid JSON: {exc}") from exc
    try:
        return SkillBank.from_dict(data, path=str(p))
    except SkillBankError as exc:
        raise SkillBankError(f"{p}: {exc}") from None


#: SDAR's fixed Search-QA routes (``SkillProvider.get_privileged_info_from_data_source``,
#: ``verl/trainer/ppo/rlsd_utils.py`` lines 112-142): data source -> task type.
SDAR_SEARCH_ROUTES = {"popqa": "entity_attribute_lookup", "nq": "direct_retrieval", "triviaqa": "direct_retrieval",
                      "hotpotqa": "multi_hop_reasoning"}


def sdar_search_task(data_source: str, prompt_text: str) -> str | None:
    """The task type SDAR gives a Search-QA turn: a fixed route for popqa, nq, triviaqa and
    hotpotqa; otherwise ``compare`` when the lower-cased prompt holds "which" and "or" and
    not "for" (plain substrings, as SDAR tests them), else ``multi_hop_reasoning`` for
    2wikimultihopqa, musique and bamboogle; else none (the general block alone)."""
    if data_source in SDAR_SEARCH_ROUTES:
        return SDAR_SEARCH_ROUTES[data_source]
    low = prompt_text.lower()
    if "which" in low and "or" in low and "for" not in low:
        return "compare"
    if data_source in ("2wikimultihopqa", "musique", "bamboogle"):
        return "multi_hop_reasoning"
    return None


def import_sdar(path: str | Path, *, env: str | None = None, match: MatchMode = "substring") -> SkillBank:
    """Import SDAR's skills folder layout into a :class:`SkillBank`.

    ``path`` is the folder (e.g. SDAR's ``skills/webshop``) or its ``skill_mapping.json``.
    The mapping holds ``skill_files`` ({skill name: markdown file}; ``general_skills`` is
    the general block), ``task_to_skill`` ({task type: skill name}) and optionally
    ``task_keywords`` ({task type: [keyword, ...]}). Each task type becomes a category
    whose block is its skill's markdown, verbatim; its ``keys`` hold the task type, so
    ``retrieve(task, key=gamefile)`` reproduces SDAR's game-file lookup. Skill files no
    task type points to become keyword-less categories (reachable by ``mode="all"`` and by
    their name as a key). Categories follow the order of ``skill_files`` (SDAR's
    ``skill_all`` order). Matching stays SDAR's plain substring test unless
    ``match="word"`` is asked for.
    """
    p = Path(path).expanduser()
    mapping_path = p if p.is_file() else p / "skill_mapping.json"
    if not mapping_path.is_file():
        raise SkillBankError(f"{p} holds no skill_mapping.json; point to SDAR's skills/<env> folder")
    folder = mapping_path.parent
    try:
        mapping = json.loads(mapping_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise SkillBankError(f"{mapping_path} is not valid JSON: {exc}") from exc
    files = mapping.get("skill_files")
    if not isinstance(files, Mapping) or not files:
        raise SkillBankError(f"{mapping_path}: 'skill_files' must map skill names to markdown files")
    task_to_skill = mapping.get("task_to_skill", {}) or {}
    task_keywords = mapping.get("task_keywords", {}) or {}
    if not isinstance(task_to_skill, Mapping) or not isinstance(task_keywords, Mapping):
        raise SkillBankError(f"{mapping_path}: 'task_to_skill' and 'task_keywords' must be objects")

    contents: dict[str, str] = {}
    for name, fname in files.items():
        fp = folder / str(fname)
        if not fp.is_file():
            raise SkillBankError(f"{mapping_path}: skill file {fname!r} for {name!r} is missing from {folder}")
        contents[str(name)] = fp.read_text(encoding="utf-8").strip()

    order = {name: i for i, name in enumerate(files)}
    kw_order = {t: i for i, t in enumerate(task_keywords)}
    task_types = list(dict.fromkeys([*task_keywords, *task_to_skill]))
    task_types.sort(key=lambda t: (order.get(task_to_skill.get(t, t), len(order)), kw_order.get(t, len(kw_order))))

    cats: list[Category] = []
    used_skills: set[str] = set()
    for t in task_types:
        skill_name = task_to_skill.get(t)
        text = contents.get(skill_name, "") if skill_name is not None else ""
        if skill_name is not None:
            used_skills.add(skill_name)
        kws = task_keywords.get(t, []) or []
        cats.append(
            Category(
                name=str(t),
                keywords=tuple(_norm_kw(k, f"task_keywords[{t!r}]") for k in kws),
                keys=(str(t),),
                text=text,
            )
        )
    for name in files:
        if name != "general_skills" and name not in used_skills and name not in {c.name for c in cats}:
            cats.append(Category(name=str(name), keys=(str(name),), text=contents[name]))
            used_skills.add(name)
    cats.sort(key=lambda c: order.get(task_to_skill.get(c.name, c.name), len(order)))
    general = Category(name="general", text=contents.get("general_skills", ""))
    return SkillBank(
        env=env or folder.name,
        general=general,
        categories=cats,
        match=match,
        select="all",
        fallback=None,
        description=f"imported from SDAR skills folder {folder.name}",
        source=f"sdar:{mapping_path}",
        path=str(mapping_path),
        sdar_order=tuple(str(t) for t in task_keywords),
    )
