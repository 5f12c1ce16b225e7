"""The built-in WebShop: reward, fuzzy matching, catalogue, search, state machine."""

from __future__ import annotations

import gzip
import math

import pytest

pytest.importorskip("bm25s")

from icsd_audit.envs import make_env  # noqa: E402
from icsd_audit.envs.base import TextEnv, parse_action  # noqa: E402
from icsd_audit.envs.webshop import WebShopEnv, load_catalogue, webshop_reward  # noqa: E402
from icsd_audit.envs.webshop.fuzzy import normalize_color, token_set_ratio  # noqa: E402
from icsd_audit.envs.webshop.generate import DATA_PATH, encode, generate  # noqa: E402
from icsd_audit.envs.webshop.reward import attribute_reward, option_reward, type_reward  # noqa: E402


@pytest.fixture(scope="module")
def cat():
    return load_catalogue()


# --------------------------------------------------------------------------- fuzzy matching
def test_token_set_ratio_hand_worked():
    # sect = "essential" (9 chars); "essential oils" (14) vs "essential oil" (13).
    # difflib ratios: sect vs sect+ab = 2*9/23 = 78.3 -> 78; sect vs sect+ba = 2*9/22 = 81.8 -> 82;
    # "essential oils" vs "essential oil": 13 matching chars, 2*13/27 = 96.3 -> 96.  max = 96.
    assert token_set_ratio("essential oils", "essential oil") == 96
    # one token set inside the other: sect == sect+ab, ratio 100 ("x-large" -> tokens {x, large}).
    assert token_set_ratio("large", "X-Large") == 100
    # "tea tree" / "tea bag": sect "tea"; "tea tree" vs "tea bag": difflib finds "tea " (4) and
    # nothing common between "tree" and "bag" -> 2*4/15 = 53; sect vs "tea tree" = 2*3/11 = 55;
    # sect vs "tea bag" = 2*3/10 = 60.  max = 60 (no match, which needs > 85).
    assert token_set_ratio("tea tree", "tea bag") == 60
    assert token_set_ratio("", "anything") == 0
    assert token_set_ratio("!!!", "anything") == 0


def test_normalize_color_uses_list_order():
    # 'blue' precedes 'light' and 'navy' in the list, so both normalise to 'blue'.
    assert normalize_color("light blue") == "blue"
    assert normalize_color("navy blue") == "blue"
    assert normalize_color("rose gold") == "gold"  # 'gold' (g) precedes 'rose' (r)
    assert normalize_color("6.76 fl oz") == "6.76 fl oz"


# --------------------------------------------------------------------------- reward
def _product(**kw):
    base = {
        "asin": "B0TEST0001",
        "title": "Aurelle Jasmine Eau de Parfum - Long Lasting",
        "query": "perfume",
        "product_category": "Beauty › Fragrance › Women's › Eau de Parfum",
        "nouns": ["aurelle", "jasmine", "eau", "parfum", "perfume"],
        "attributes": ["long lasting", "paraben free", "vegan"],
        "features": ["Long Lasting: designed for everyday use."],
        "description": "A jasmine eau de parfum.",
        "options": {"size": ["3.4 fl oz", "6.76 fl oz"]},
        "price": 80.0,
    }
    base.update(kw)
    return base


GOAL = {
    "asin": "B0TEST0001",
    "query": "perfume",
    "product_category": "Beauty › Fragrance › Women's › Eau de Parfum",
    "nouns": ["aurelle", "jasmine", "eau", "parfum", "perfume"],
    "attributes": ["long lasting", "paraben free"],
    "goal_options": {"size": "6.76 fl oz"},
    "price_upper": 100.0,
    "instruction_text": "i need a long lasting and paraben free perfume in size 6.76 fl oz, "
    "and price lower than 100.00 dollars",
}


def test_reward_exact_purchase_is_one():
    # r_type = 1 (same query); 2/2 attributes, 1/1 option, price 80 <= 100:
    # (2 + 1 + 1) / (2 + 1 + 1) = 1.0
    info = webshop_reward(_product(), GOAL, 80.0, {"size": "6.76 fl oz"})
    assert info.reward == 1.0
    assert (info.r_att, info.r_option, info.r_price, info.r_type) == (1.0, 1.0, 1.0, 1.0)


def test_reward_partial_purchase():
    # Product lacks "paraben free" (not in attributes, title, features or description) -> 1 of 2.
    # Chosen "3.4 fl oz" vs goal "6.76 fl oz": tokens {3,4,fl,oz} / {6,76,fl,oz}, best difflib ratio
    # is "fl oz 3 4" vs "fl oz 6 76" = 2*7/19 = 74 <= 85 -> no option match.  Price 120 > 100 -> 0.
    # total = 1 * (1 + 0 + 0) / (2 + 1 + 1) = 0.25
    p = _product(attributes=["long lasting", "vegan"])
    info = webshop_reward(p, GOAL, 120.0, {"size": "3.4 fl oz"})
    assert info.num_attr_matches == 1 and info.num_option_matches == 0 and info.r_price == 0.0
    assert info.reward == pytest.approx(0.25)
    # No option chosen at all: same 0.25; with the right option: (1 + 1 + 0) / 4 = 0.5
    assert webshop_reward(p, GOAL, 120.0, {}).reward == pytest.approx(0.25)
    assert webshop_reward(p, GOAL, 120.0, {"size": "6.76 fl oz"}).reward == pytest.approx(0.5)


def test_reward_attribute_found_in_text_and_fuzzy():
    # "paraben free" absent from attributes but present in the description -> counts.
    p = _product(attributes=["long lasting"], description="Made paraben free in France.")
    assert attribute_reward(p, ["long lasting", "paraben free"]) == (1.0, 2)
    # WebShop's own example: goal "essential oils" matches attribute "essential oil" (96 > 85);
    # "tea tree" matches nothing (60 against "tea bag"): 1 of 2.
    q = _product(attributes=["essential oil", "tea bag"], title="x", features=[], description="")
    assert attribute_reward(q, ["essential oils", "tea tree"]) == (0.5, 1)


def test_reward_option_colour_normalisation():
    # "navy blue" and "light blue" both normalise to "blue" -> match; "red" does not (and "red"
    # is not in the title, features or description either).
    p = _product()
    assert option_reward(p, ["navy blue"], {"color": "light blue"}) == (1.0, 1)
    # style "large" vs goal "x-large": token sets {large} and {x, large}; sect = "large" equals
    # sect + diff = "large", so token_set_ratio = 100 > 85 -> a fuzzy match; color "red" matches
    # nothing: 1 match of 2 goal options
    assert option_reward(p, ["navy blue", "x-large"], {"color": "red", "style": "large"}) == (0.5, 1)
    # the same value as a *size* must equal a goal value: no match
    assert option_reward(p, ["navy blue", "x-large"], {"color": "red", "size": "large"}) == (0.0, 0)
    assert option_reward(p, [], {"color": "red"}) == (None, 0)


def test_option_reward_size_is_matched_exactly():
    # WebShop's EXACT_MATCH_OPTS = ["size"]: "6.76 fl. oz" and "6.76 fl oz" have the same token set
    # (token_set_ratio 100), so any other dimension matches fuzzily, but a size must be equal.
    p = _product()
    assert option_reward(p, ["6.76 fl oz"], {"size": "6.76 fl oz"}) == (1.0, 1)
    assert option_reward(p, ["6.76 fl oz"], {"size": "6.76 fl. oz"}) == (0.0, 0)
    assert option_reward(p, ["6.76 fl oz"], {"Size": "6.76 fl. oz"}) == (0.0, 0)  # key compared lower-cased
    assert option_reward(p, ["6.76 fl oz"], {"volume": "6.76 fl. oz"}) == (1.0, 1)


def test_option_reward_falls_back_to_title_features_description():
    # a chosen value that matches no goal value still counts when it occurs verbatim in the
    # lower-cased title, features or description (size included)
    p = _product(title="Aurelle Jasmine Eau de Parfum - Large Bottle", features=["Comes in red glass."],
                 description="A jasmine eau de parfum in a travel case.")
    assert option_reward(p, ["x-large"], {"size": "large"}) == (1.0, 1)  # "large" in the title
    assert option_reward(p, ["navy blue"], {"color": "red"}) == (1.0, 1)  # "red" in the features
    assert option_reward(p, ["navy blue"], {"style": "travel case"}) == (1.0, 1)  # in the description
    assert option_reward(p, ["navy blue"], {"style": "gift box"}) == (0.0, 0)
    # the value is normalised before the search: "dark red" -> "dark" (earlier in the list), absent
    assert option_reward(p, ["navy blue"], {"color": "dark red"}) == (0.0, 0)


def test_option_reward_counts_chosen_options_not_goal_options():
    # Two chosen values that both normalise to "blue" against one goal value "navy blue" ("blue"):
    # WebShop counts 2 matches and reports r_option = 2 / 1.
    p = _product()
    assert option_reward(p, ["navy blue"], {"color": "light blue", "trim": "sky blue"}) == (2.0, 2)
    # one chosen option against two goal options: at most 1 of 2
    assert option_reward(p, ["navy blue", "6.76 fl oz"], {"color": "blue"}) == (0.5, 1)
    # the total: goal with 2 attributes + 1 option, product has both attributes, price ok:
    # (2 + 0 + 1) / 4 with a wrong size not in the text
    assert webshop_reward(p, GOAL, 80.0, {"size": "3.4 fl oz"}).reward == pytest.approx(0.75)


def test_type_reward_rules():
    goal = {"query": "perfume", "product_category": "a › b › c", "nouns": ["n1", "n2", "n3", "n4", "n5"]}

    def r(query, path, nouns):
        return type_reward({"query": query, "product_category": path, "nouns": nouns}, goal)

    # same query -> 1.0 even with 2/5 nouns
    assert r("perfume", "x › y", ["n1", "n2"])["r_type"] == 1.0
    # query and category differ, 1/5 = 0.2 nouns (not > 0.2) -> 0.5
    out = r("lotion", "a › x › y", ["n1"])
    assert (out["r_type"], out["category_match"], out["title_score"]) == (0.5, False, 0.2)
    # two shared category levels count as a category match -> 1.0
    assert r("lotion", "c › a › z", ["n1"])["r_type"] == 1.0
    # 2/5 = 0.4 > 0.2 title overlap alone -> 1.0
    assert r("lotion", "x", ["n1", "n2"])["r_type"] == 1.0
    # no noun in common -> 0.0 whatever the query says
    assert r("perfume", "a › b › c", ["zz"])["r_type"] == 0.0
    # overlap below 0.1 -> 0.1 (1 of 12 nouns = 0.083)
    goal12 = dict(goal, nouns=[f"n{i}" for i in range(12)])
    assert type_reward({"query": "perfume", "product_category": "a", "nouns": ["n0"]}, goal12)["r_type"] == 0.1


def test_reward_scaled_by_type():
    # r_type 0.5 (different query and category, 1/5 nouns) times a perfect match = 0.5
    p = _product(query="lotion", product_category="Beauty › Skin Care", nouns=["aurelle", "lotion"])
    info = webshop_reward(p, GOAL, 80.0, {"size": "6.76 fl oz"})
    assert info.r_type == 0.5 and info.reward == pytest.approx(0.5)


# --------------------------------------------------------------------------- catalogue
def test_catalogue_size_categories_and_ids(cat):
    assert len(cat.products) >= 1000
    assert len({p["category"] for p in cat.products}) >= 5
    asins = [p["asin"] for p in cat.products]
    assert len(set(asins)) == len(asins)
    assert all(len(a) == 10 and a.startswith("B0") and a.isalnum() and a.isupper() for a in asins)
    for p in cat.products:
        assert p["attributes"] and p["price"] > 0 and p["title"] and p["nouns"]
        values = [v for vs in p["options"].values() for v in vs]
        assert len(values) == len(set(values))
    assert DATA_PATH.stat().st_size < 1_000_000


def test_splits_fixed_and_disjoint(cat):
    train, evals = cat.goals("train"), cat.goals("eval")
    assert len(train) == 1900 and len(evals) == 500
    assert not {g["asin"] for g in train} & {g["asin"] for g in evals}
    assert not {g["instruction_text"] for g in train} & {g["instruction_text"] for g in evals}
    for g in train[:50] + evals[:50]:
        assert g["asin"] in cat.by_asin and g["attributes"] and g["price_upper"] > 0
        assert "price lower than" in g["instruction_text"]


def test_regeneration_equals_shipped_file():
    assert gzip.decompress(DATA_PATH.read_bytes()) == encode(generate())


def test_every_goal_rewards_its_target_with_one_and_wrong_options_less(cat):
    """The target with the goal options scores 1; a wrong option scores less unless WebShop's
    text fallback credits it (its normalised value occurs in the title, features or
    description, e.g. colour "blue" inside "bluetooth"), which the original reward does too."""
    from icsd_audit.envs.webshop.fuzzy import normalize_color

    credited = total = 0
    for split in ("train", "eval"):
        for g in cat.goals(split):
            p = cat.by_asin[g["asin"]]
            assert webshop_reward(p, g, p["price"], g["goal_options"]).reward == 1.0
            text = " ".join([p["title"], " ".join(p["features"]), p["description"]]).lower()
            for name, values in p["options"].items():
                for v in values:
                    if v != g["goal_options"][name]:
                        total += 1
                        wrong = dict(g["goal_options"], **{name: v})
                        if webshop_reward(p, g, p["price"], wrong).reward == 1.0:
                            assert normalize_color(v) in text, (g["asin"], name, v)
                            credited += 1
    assert total > 1000 and credited < 0.1 * total


# --------------------------------------------------------------------------- search
def test_bm25_finds_each_product_by_its_title(cat):
    engine = cat.search_engine
    for i, p in enumerate(cat.products):
        assert i in engine.search(p["title"])[:10], p["title"]


def test_bm25_is_deterministic_and_bounded(cat):
    engine = cat.search_engine
    q = "long lasting lipstick"
    assert engine.search(q) == engine.search(q) == engine.search(q, 50)
    assert len(engine.search("kitchen")) == 50
    assert engine.search("zzzz qqqq") == ()
    assert engine.search("") == ()


# --------------------------------------------------------------------------- state machine
def _oracle(env: WebShopEnv, goal) -> list:
    """Search the target's title, page to it, pick the goal options, buy."""
    results = [env.step(f"search[{goal['name']}]")]
    target = f"click[{goal['asin'].lower()}]"
    while target not in results[-1].observation.available_actions:
        results.append(env.step("click[next >]"))
    results.append(env.step(target))
    for value in goal["goal_options"].values():
        results.append(env.step(f"click[{value}]"))
    results.append(env.step("click[buy now]"))
    return results


def test_transitions_search_results_item_option_buy():
    env = WebShopEnv("eval", max_steps=15)
    assert isinstance(env, TextEnv)
    obs = env.reset(3)
    goal = env.goal
    assert obs.text == "Search" and obs.available_actions == ("search[<your query>]",)
    assert obs.instruction == goal["instruction_text"] and obs.meta["page"] == "search"

    r = env.step(f"search[{goal['name']}]")
    o = r.observation
    assert r.info["valid_action"] and not r.done and r.reward == 0.0 and o.meta["page"] == "results"
    assert o.text.startswith("Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] ")
    assert o.available_actions[:2] == ("click[back to search]", "click[next >]")
    assert len(o.available_actions) == 2 + 10

    r = env.step("click[next >]")
    assert r.observation.text.startswith("Back to Search [SEP] Page 2 (Total results: 50) [SEP] < Prev [SEP] Next >")
    r = env.step("click[< prev]")
    assert "Page 1 " in r.observation.text

    r = env.step(f"click[{goal['asin']}]")  # upper case works too
    o = r.observation
    product = env.catalogue.by_asin[goal["asin"]]
    assert o.meta["page"] == "item" and product["title"] in o.text
    assert o.text.startswith("Back to Search [SEP] < Prev")
    assert o.text.endswith(f"Price: ${product['price']:.2f} [SEP] Rating: N.A. [SEP] Description [SEP] "
                           "Features [SEP] Reviews [SEP] Buy Now")
    for name, values in product["options"].items():
        assert f" [SEP] {name} [SEP] " + " [SEP] ".join(values) in o.text
        assert all(f"click[{v}]" in o.available_actions for v in values)

    r = env.step("click[description]")
    assert r.observation.text == f"Back to Search [SEP] < Prev [SEP] {product['description']}"
    assert r.observation.available_actions == ("click[back to search]", "click[< prev]")
    r = env.step("click[< prev]")
    assert r.observation.meta["page"] == "item"
    for value in goal["goal_options"].values():
        r = env.step(f"click[{value}]")
        assert r.info["valid_action"] and r.observation.meta["options"][
            next(k for k, v in goal["goal_options"].items() if v == value)] == value
    r = env.step("click[buy now]")
    assert r.done and r.reward == 1.0 and r.info["won"] and r.info["score"] == 1.0
    assert r.info["purchased"]["asin"] == goal["asin"] and r.observation.available_actions == ()
    with pytest.raises(RuntimeError):
        env.step("click[buy now]")


def test_back_to_search_and_prev_reset_options():
    env = WebShopEnv("train")
    env.reset(0)
    goal = env.goal
    _ = env.step(f"search[{goal['name']}]")
    r = env.step(f"click[{goal['asin'].lower()}]")
    product = env.catalogue.by_asin[goal["asin"]]
    if product["options"]:
        r = env.step(f"click[{next(iter(product['options'].values()))[0]}]")
        assert r.observation.meta["options"]
    r = env.step("click[< prev]")
    assert r.observation.meta["page"] == "results" and r.observation.meta["options"] == {}
    r = env.step("click[back to search]")
    assert r.observation.text == "Search" and r.observation.meta["asin"] is None


def test_invalid_actions_are_flagged_noops():
    env = WebShopEnv("eval", max_steps=15)
    first = env.reset(0)
    for bad in ["click[buy now]", "search[]", "search[<your query>]", "hello", "click[search]", ""]:
        r = env.step(bad)
        assert not r.info["valid_action"] and r.reward == 0.0 and not r.done
        assert r.observation.text == first.text and r.observation.available_actions == first.available_actions
    assert r.info["steps"] == 6
    env.step("search[perfume]")
    r = env.step("search[lipstick]")  # no search bar on the results page
    assert not r.info["valid_action"] and r.observation.meta["page"] == "results"
    r = env.step("click[b0notthere]")
    assert not r.info["valid_action"]


def test_max_steps_ends_with_zero_reward():
    env = WebShopEnv("eval", max_steps=3)
    env.reset(0)
    assert not env.step("search[perfume]").done
    assert not env.step("click[next >]").done
    r = env.step("click[next >]")
    assert r.done and r.reward == 0.0 and not r.info["won"] and r.info["truncated"]
    # buying on the last allowed step still counts (no options chosen: reward > 0, not truncated)
    env = WebShopEnv("eval", max_steps=3)
    env.reset(0)
    g = env.goal
    env.step(f"search[{g['name']}]")
    env.step(f"click[{g['asin'].lower()}]")
    r = env.step("click[buy now]")
    assert r.done and not r.info["truncated"] and r.reward > 0.0
    # an inadmissible action on the last step ends the episode with 0
    env.reset(0)
    env.step(f"search[{g['name']}]")
    env.step(f"click[{g['asin'].lower()}]")
    r = env.step("click[nonsense]")
    assert r.done and r.info["truncated"] and not r.info["valid_action"] and r.reward == 0.0


def test_oracle_policy_wins_every_eval_task():
    env = WebShopEnv("eval", max_steps=30)
    for i in range(env.num_tasks):
        env.reset(i)
        results = _oracle(env, env.goal)
        last = results[-1]
        assert all(r.info["valid_action"] for r in results)
        assert last.done and last.reward == 1.0 and last.info["won"], env.goal["instruction_text"]


def test_wrong_option_or_product_scores_below_one():
    env = WebShopEnv("eval")
    env.reset(1)
    g = env.goal
    env.step(f"search[{g['name']}]")
    r = env.step(f"click[{g['asin'].lower()}]")
    r = env.step("click[buy now]")  # no options chosen
    p = env.catalogue.by_asin[g["asin"]]
    n_opt = len(g["goal_options"])
    expected = (len(g["attributes"]) + 0 + 1) / (len(g["attributes"]) + n_opt + 1)
    assert r.reward == pytest.approx(expected) and (r.info["won"] == (n_opt == 0))
    assert r.info["reward_info"]["num_option_matches"] == 0 and p["price"] <= g["price_upper"]


def test_determinism_with_seed():
    def rollout(seed):
        env = WebShopEnv("train", seed=seed)
        out = []
        for _ in range(5):
            obs = env.reset()
            out.append(obs.instruction)
            r = env.step(f"search[{obs.instruction}]")
            out.append(r.observation.text)
            out.append(r.observation.available_actions)
        return out

    assert rollout(7) == rollout(7)
    assert rollout(7) != rollout(8)


def test_include_instruction_and_make_env():
    env = make_env("webshop", split="eval", include_instruction=True)
    obs = env.reset(0)
    assert obs.text == f"WebShop [SEP] Instruction: [SEP] {obs.instruction} [SEP] Search"
    r = env.step("search[perfume]")
    assert r.observation.text.startswith(f"Instruction: [SEP] {obs.instruction} [SEP] Back to Search")
    with pytest.raises(ValueError):
        make_env("nope")
    with pytest.raises(ValueError):
        WebShopEnv("test")
    with pytest.raises(IndexError):
        env.reset(10_000)
    import numpy as np

    assert env.reset(np.int64(3)).instruction == env.tasks[3]["instruction_text"]
    with pytest.raises(TypeError):
        env.reset("3")


def test_parser_and_env_together():
    env = WebShopEnv("eval")
    obs = env.reset(0)
    reply = f"<think>search first</think><action>search[{obs.instruction}]</action>"
    parsed = parse_action(reply, obs.available_actions)
    assert parsed.valid
    r = env.step(parsed.action)
    assert r.info["valid_action"] and r.observation.meta["page"] == "results"
    parsed = parse_action("<action>click[buy now]</action>", r.observation.available_actions)
    assert not parsed.valid and not env.step(parsed.action).info["valid_action"]


def test_reset_accepts_goal_mapping(cat):
    env = WebShopEnv("train")
    goal = dict(cat.goals("eval")[5])
    obs = env.reset(goal)
    assert obs.instruction == goal["instruction_text"]
    with pytest.raises(ValueError):
        env.reset({"asin": "B0NOPE"})
    assert math.isclose(sum(len(v) for v in cat.splits.values()), 2400)
