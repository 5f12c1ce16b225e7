"""SkillBank: format, keyword retrieval (SDAR semantics), SDAR folder import, shipped banks."""

from __future__ import annotations

import json

import pytest

from icsd_audit.train.teacher.skills import (
    BUILTIN_BANKS,
    SkillBank,
    SkillBankError,
    builtin_bank_path,
    import_sdar,
    load_skillbank,
)


def bank_dict(**over):
    d = {
        "format": "icsd-skillbank",
        "version": 1,
        "env": "toy",
        "match": "substring",
        "general": {"skills": [{"id": "g1", "title": "Plan", "text": "Plan first."}, "Be brief."]},
        "categories": [
            {"name": "shoes", "keywords": ["shoe", "boot"], "skills": [{"id": "s1", "text": "Pick the size."}]},
            {
                "name": "hats",
                "keywords": ["hat"],
                "keys": ["headwear"],
                "skills": [{"id": "h1", "text": "Check the brim."}],
            },
            {"name": "combo", "keywords": [["red", "dress"]], "skills": [{"id": "c1", "text": "Colour matters."}]},
            {"name": "other", "skills": [{"id": "o1", "text": "Anything else."}]},
        ],
    }
    d.update(over)
    return d


GENERAL = "### GENERAL SKILLS ###\n1. Plan: Plan first.\n2. Be brief."
SHOES = "### TASK: shoes ###\n1. Pick the size."
HATS = "### TASK: hats ###\n1. Check the brim."


def test_render_and_single_match():
    b = SkillBank.from_dict(bank_dict())
    r = b.retrieve("I want leather BOOTS")  # lower-cased before matching
    assert r.text == GENERAL + "\n\n" + SHOES
    assert r.categories == ("shoes",)
    assert r.skill_ids == ("g1", "general.2", "s1")
    assert r.how == "keyword"


def test_all_matches_are_concatenated_in_bank_order():
    b = SkillBank.from_dict(bank_dict())
    r = b.retrieve("a hat and a shoe")
    assert r.text == GENERAL + "\n\n" + SHOES + "\n\n" + HATS
    b1 = SkillBank.from_dict(bank_dict(select="first"))
    assert b1.retrieve("a hat and a shoe").categories == ("shoes",)


def test_substring_vs_word_matching():
    sub = SkillBank.from_dict(bank_dict())
    word = SkillBank.from_dict(bank_dict(match="word"))
    # SDAR's substring test fires on "that"; whole-word matching does not
    assert sub.retrieve("is that cheap").categories == ("hats",)
    assert word.retrieve("is that cheap").categories == ()
    # whole words allow plural endings
    assert word.retrieve("two hats").categories == ("hats",)
    assert word.retrieve("rain boots").categories == ("shoes",)


def test_and_keywords():
    b = SkillBank.from_dict(bank_dict())
    assert b.retrieve("a red summer dress").categories == ("combo",)
    assert b.retrieve("a red scarf").categories == ()


def test_no_match_general_only_or_fallback():
    b = SkillBank.from_dict(bank_dict())
    r = b.retrieve("a lamp")
    assert r.text == GENERAL and r.categories == () and r.how == "general"
    fb = SkillBank.from_dict(bank_dict(fallback="other"))
    r = fb.retrieve("a lamp")
    assert r.categories == ("other",) and r.how == "fallback"
    # keyword-less categories never match by keyword
    assert "other" not in b.retrieve("other things").categories


def test_key_lookup_and_modes():
    b = SkillBank.from_dict(bank_dict())
    assert b.retrieve("a shoe", key="headwear").categories == ("hats",)  # key wins
    assert b.retrieve("a shoe", key="/path/headwear-42/game").categories == ("hats",)  # substring key
    assert b.retrieve("a shoe", key="unknown").categories == ("shoes",)  # falls back to keywords
    assert b.retrieve("x", mode="all").categories == ("shoes", "hats", "combo", "other")
    assert b.retrieve("a shoe", mode="general").text == GENERAL
    with pytest.raises(ValueError):
        b.retrieve("x", mode="some")


def test_roundtrip_json(tmp_path):
    b = SkillBank.from_dict(bank_dict(match="word", fallback="other"))
    p = b.save(tmp_path / "bank.json")
    b2 = load_skillbank(p)
    assert b2.to_dict() == b.to_dict()
    assert b2.retrieve("boots").text == b.retrieve("boots").text


@pytest.mark.parametrize(
    "over, msg",
    [
        ({"format": "other"}, "not a SkillBank"),
        ({"version": 2}, "version"),
        ({"match": "fuzzy"}, "match"),
        ({"fallback": "nope"}, "fallback"),
        ({"categories": [{"name": "a"}, {"name": "a"}]}, "duplicate category"),
        ({"categories": [{"keywords": ["x"]}]}, "name"),
        ({"categories": [{"name": "a", "keywords": [""]}]}, "empty keyword"),
        ({"categories": [{"name": "a", "skills": [{"id": "g1", "text": "dup id"}]}]}, "duplicate skill ids"),
    ],
)
def test_validation_errors(over, msg):
    with pytest.raises(SkillBankError, match=msg):
        SkillBank.from_dict(bank_dict(**over))


def test_file_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(bank_dict(match="fuzzy")))
    with pytest.raises(SkillBankError, match=r"bad\.json: match must be"):
        load_skillbank(p)
    p.write_text("{not json")
    with pytest.raises(SkillBankError, match=r"bad\.json is not valid JSON"):
        load_skillbank(p)


def test_missing_bank_message():
    with pytest.raises(SkillBankError, match="not found"):
        load_skillbank("/no/such/bank.json")
    with pytest.raises(SkillBankError, match="built-in"):
        builtin_bank_path("minecraft")


# ----------------------------------------------------------------------------- SDAR import


def sdar_reference(folder, prompt_text, skill_all=False):
    """SDAR's SkillProvider.get_privileged_info_from_prompt, restated for the test."""
    mapping = json.loads((folder / "skill_mapping.json").read_text())
    contents = {n: (folder / f).read_text().strip() for n, f in mapping["skill_files"].items()}
    general = contents.get("general_skills", "")
    if skill_all:
        return "\n\n".join([general] + [c for n, c in contents.items() if n != "general_skills"])
    text = prompt_text.lower()
    matched = [t for t, kws in mapping.get("task_keywords", {}).items() if kws and any(k in text for k in kws)]
    parts = [general]
    for t in matched:
        name = mapping["task_to_skill"].get(t)
        if name in contents:
            parts.append(contents[name])
    return "\n\n".join(parts)


def sdar_gamefile_reference(folder, gamefile):
    """SDAR's get_privileged_info(gamefile): first task type that occurs in the path."""
    mapping = json.loads((folder / "skill_mapping.json").read_text())
    contents = {n: (folder / f).read_text().strip() for n, f in mapping["skill_files"].items()}
    parts = [contents.get("general_skills", "")]
    for t, name in mapping["task_to_skill"].items():
        if t in gamefile:
            if name in contents:
                parts.append(contents[name])
            break
    return "\n\n".join(parts)


@pytest.fixture
def sdar_folder(tmp_path):
    d = tmp_path / "webshop"
    d.mkdir()
    files = {
        "general_skills": "general_skills.md",
        "apparel": "apparel.md",
        "footwear": "footwear.md",
        "other": "other.md",
    }
    (d / "general_skills.md").write_text("### GENERAL SKILLS ###\n\n1. Search the core terms.\n")
    (d / "apparel.md").write_text("### TASK: apparel ###\n\n1. Set size and colour.\n")
    (d / "footwear.md").write_text("### TASK: footwear ###\n\n1. Pick the shoe size.\n")
    (d / "other.md").write_text("### TASK: other ###\n\n1. Read the description.\n")
    mapping = {
        "skill_files": files,
        "task_to_skill": {"apparel": "apparel", "footwear": "footwear", "other": "other"},
        "task_keywords": {"apparel": ["shirt", "dress"], "footwear": ["shoe", "boot"], "other": []},
    }
    (d / "skill_mapping.json").write_text(json.dumps(mapping))
    return d


@pytest.mark.parametrize(
    "task",
    [
        "i need a cotton shirt",
        "shoes to go with my dress",  # two matches, concatenated
        "a blue lamp",  # none: general only
        "T-SHIRT",  # case
        "a bootcut jean",  # SDAR substring semantics: "boot" fires
    ],
)
def test_import_sdar_reproduces_sdar_text(sdar_folder, task):
    bank = import_sdar(sdar_folder)
    assert bank.retrieve(task).text == sdar_reference(sdar_folder, task)


def test_import_sdar_all_and_gamefile_modes(sdar_folder):
    bank = load_skillbank(sdar_folder)  # a folder goes through the importer
    assert bank.env == "webshop"
    assert bank.retrieve("x", mode="all").text == sdar_reference(sdar_folder, "x", skill_all=True)
    for gf in ["/data/footwear-12/game.tw", "/data/unknown/game.tw"]:
        assert bank.retrieve("", key=gf).text == sdar_gamefile_reference(sdar_folder, gf)
    assert [c.name for c in bank.categories] == ["apparel", "footwear", "other"]
    # keep it: an imported bank saves as an icsd bank and reloads identically
    assert (
        load_skillbank(load_skillbank(sdar_folder / "skill_mapping.json").save(sdar_folder.parent / "b.json"))
        .retrieve("dress")
        .text
        == bank.retrieve("dress").text
    )


def test_import_sdar_without_keywords(tmp_path):
    # SDAR's search mapping has no task_keywords: categories are reachable by key only
    d = tmp_path / "search"
    d.mkdir()
    (d / "general_skills.md").write_text("G")
    (d / "compare.md").write_text("C")
    (d / "skill_mapping.json").write_text(
        json.dumps(
            {
                "skill_files": {"general_skills": "general_skills.md", "compare": "compare.md"},
                "task_to_skill": {"compare": "compare"},
            }
        )
    )
    bank = import_sdar(d)
    assert bank.retrieve("which is older, a or b?").text == "G"
    assert bank.retrieve("q", key="compare").text == "G\n\nC"


def test_import_sdar_errors(tmp_path):
    with pytest.raises(SkillBankError, match="skill_mapping.json"):
        import_sdar(tmp_path)
    (tmp_path / "skill_mapping.json").write_text(json.dumps({"skill_files": {"general_skills": "missing.md"}}))
    with pytest.raises(SkillBankError, match="missing"):
        import_sdar(tmp_path)


# ----------------------------------------------------------------------------- shipped banks


@pytest.mark.parametrize("name", BUILTIN_BANKS)
def test_builtin_banks_load_and_have_content(name):
    bank = load_skillbank(name)
    assert bank.env == name
    assert len(bank.general.skills) >= 4
    assert len(bank.categories) >= 4
    for c in bank.categories:
        assert c.keywords and c.keys and len(c.skills) >= 2, c.name
        for s in c.skills:
            assert 20 <= len(s.text) <= 400, s.id
    assert bank.retrieve("anything").text.startswith("### GENERAL SKILLS ###")


@pytest.mark.parametrize(
    "task, expected",
    [
        ("i need a long sleeve women's cotton t-shirt in x-large, and price lower than 30.00 dollars", ("apparel",)),
        ("find me men's slip on loafers with rubber sole in size 10, price lower than 60.00 dollars", ("footwear",)),
        ("i want a paraben free shampoo for dry hair, 16 fl oz", ("beauty_personal_care",)),
        ("i am looking for gluten free snacks, pack of 12", ("grocery_food",)),
        ("a usb-c charger cable 6 ft that is fast charging", ("electronics",)),
        ("a velvet throw pillow cover for the living room", ("home_kitchen",)),
        ("genuine leather wallet with rfid blocking for men", ("accessories",)),
        ("what is that thing", ()),  # no "hat" inside "that"
    ],
)
def test_webshop_bank_retrieval(task, expected):
    assert load_skillbank("webshop").retrieve(task).categories == expected


@pytest.mark.parametrize(
    "task, expected",
    [
        ("put a clean apple in fridge.", "pick_clean_then_place_in_recep"),
        ("put two cellphone in bed.", "pick_two_obj_and_place"),
        ("look at alarmclock under the desklamp.", "look_at_obj_in_light"),
        ("examine the book with the desklamp.", "look_at_obj_in_light"),
        ("heat some egg and put it in garbagecan.", "pick_heat_then_place_in_recep"),
        ("put a cool tomato in microwave.", "pick_cool_then_place_in_recep"),
        ("put some spraybottle on toilet.", "pick_and_place_simple"),
    ],
)
def test_alfworld_bank_retrieval(task, expected):
    bank = load_skillbank("alfworld")
    assert bank.retrieve(task).categories == (expected,)
    gamefile = f"/data/json_2.1.1/train/{expected}-Obj-None-Recep-1/trial_T1/game.tw-pddl"
    assert bank.retrieve("", key=gamefile).categories == (expected,)


@pytest.mark.parametrize(
    "question, source, expected",
    [
        ("who was born first, john lennon or paul mccartney?", None, "compare"),
        ("what is the place of birth of the director of film inception?", None, "multi_hop_reasoning"),
        ("what is george rankin's occupation?", None, "entity_attribute_lookup"),
        ("who sang i will always love you?", None, "direct_retrieval"),
        ("anything", "popqa", "entity_attribute_lookup"),
        ("anything", "hotpotqa", "multi_hop_reasoning"),
        ("anything", "nq", "direct_retrieval"),
    ],
)
def test_searchqa_bank_retrieval(question, source, expected):
    assert load_skillbank("searchqa").retrieve(question, key=source).categories == (expected,)


def test_webshop_bank_covers_the_builtin_catalogue():
    """Every product type of the built-in WebShop catalogue retrieves a task category."""
    from icsd_audit.envs.webshop.spec import CATEGORIES

    bank = load_skillbank("webshop")
    missed = [
        t.name
        for c in CATEGORIES
        for t in c.types
        if not bank.retrieve(f"i am looking for {t.name}, and price lower than 40.00 dollars").categories
    ]
    assert missed == []


# ----------------------------------------------------------------------------- SDAR's rule (default)


def test_retrieve_sdar_is_substring_on_the_whole_prompt_whatever_the_bank_says():
    word = SkillBank.from_dict(bank_dict(match="word", select="first", fallback="other"))
    # the bank's own rule: whole words, first match, fallback
    assert word.retrieve("is that cheap").categories == ("other",)
    # SDAR's rule: plain substrings ("that" contains "hat"), every match, no fallback
    assert word.retrieve_sdar("is that cheap").categories == ("hats",)
    assert word.retrieve_sdar("a hat and a shoe").categories == ("shoes", "hats")
    r = word.retrieve_sdar("a lamp")
    assert r.categories == () and r.how == "general" and r.text == GENERAL
    assert word.retrieve_sdar("a shoe", key="headwear").categories == ("hats",)


def test_retrieve_sdar_matches_sdar_reference_on_full_prompts(sdar_folder):
    bank = import_sdar(sdar_folder)
    prompt = ("<|im_start|>user\nYour task is to: buy a blue lamp.\nCurrent observation: Search results: "
              "[SEP] Leather Boot [SEP] $40\nAdmissible actions: click[b0x]<|im_end|>")
    # the instruction alone names no category; the observation names "boot"
    assert bank.retrieve("buy a blue lamp").categories == ()
    assert bank.retrieve_sdar(prompt).categories == ("footwear",)
    assert bank.retrieve_sdar(prompt).text == sdar_reference(sdar_folder, prompt)


def test_teacher_uses_the_configured_rule():
    from types import SimpleNamespace

    from icsd_audit.train.teacher.self_teacher import SelfTeacher

    bank = SkillBank.from_dict(bank_dict(match="word"))
    ctx = SimpleNamespace(task="buy a lamp")

    class Builder:
        def student_text(self, c):
            return f"task: {c.task}\nobservation: results [SEP] Boot Shop"

    row = SimpleNamespace(ctx=ctx)
    kw = dict(skill_mode="match", micro_batch_rows=1, pad_id=0, device=None, temperature=1.0, precision="float32")
    sdar = SelfTeacher(None, Builder(), bank, skill_match="sdar", **kw)
    ours = SelfTeacher(None, Builder(), bank, skill_match="instruction", **kw)
    assert sdar.skill_for(row) == GENERAL + "\n\n" + SHOES  # "boot" in the observation
    assert ours.skill_for(row) == GENERAL  # nothing in the instruction


def test_retrieve_sdar_keeps_sdar_keyword_order(tmp_path):
    d = tmp_path / "webshop"
    d.mkdir()
    (d / "general_skills.md").write_text("G")
    (d / "a.md").write_text("A")
    (d / "b.md").write_text("B")
    mapping = {"skill_files": {"general_skills": "general_skills.md", "a": "a.md", "b": "b.md"},
               "task_to_skill": {"a": "a", "b": "b"},
               "task_keywords": {"b": ["boot"], "a": ["shirt"]}}  # keyword order differs from file order
    (d / "skill_mapping.json").write_text(json.dumps(mapping))
    bank = import_sdar(d)
    prompt = "a shirt and a boot"
    assert bank.retrieve_sdar(prompt).text == sdar_reference(d, prompt) == "G\n\nB\n\nA"
    assert bank.retrieve(prompt).text == "G\n\nA\n\nB"  # the bank-order rule


# ----------------------------------------------------------------------------- SDAR's Search-QA routing


def _sdar_search_folder(root):
    """SDAR's skills/search layout: four task types, no keywords (it routes by data source)."""
    import json as _json

    d = root / "search"
    d.mkdir()
    files = {"general_skills": "general_skills.md", "compare": "compare.md", "direct_retrieval": "direct_retrieval.md",
             "entity_attribute_lookup": "entity_attribute_lookup.md", "multi_hop_reasoning": "multi_hop_reasoning.md"}
    for name, f in files.items():
        (d / f).write_text(f"## {name}\n- skill\n")
    (d / "skill_mapping.json").write_text(_json.dumps({"skill_files": files,
                                                       "task_to_skill": {k: k for k in files if k != "general_skills"}}))
    return d


@pytest.mark.parametrize("source,prompt,expect", [
    ("popqa", "What is X's occupation?", ("entity_attribute_lookup",)),
    ("nq", "who directed the film?", ("direct_retrieval",)),
    ("triviaqa", "which or for", ("direct_retrieval",)),  # the fixed routes come first
    ("hotpotqa", "Which is older, A or B?", ("multi_hop_reasoning",)),
    ("bamboogle", "which one is older, a or b?", ("compare",)),
    ("musique", "Which one is older, A or B? Search for information", ("multi_hop_reasoning",)),  # 'for' blocks compare
    ("2wikimultihopqa", "Who is the spouse of the director?", ("multi_hop_reasoning",)),
    ("unknown_source", "who?", ()),
])
def test_sdar_search_folder_routes_data_sources_as_sdar(tmp_path, source, prompt, expect):
    """SDAR's get_privileged_info_from_data_source (rlsd_utils.py lines 112-142), worked by hand per subset."""
    from icsd_audit.train.teacher.skills import import_sdar

    bank = import_sdar(_sdar_search_folder(tmp_path))
    got = bank.retrieve_sdar(prompt, key=source)
    assert got.categories == expect
    assert got.how == ("key" if expect else "general")
