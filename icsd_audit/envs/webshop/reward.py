"""WebShop's purchase reward, re-implemented from ``web_agent_site/engine/goal.py``.

``total = r_type * (n_att + n_opt + r_price) / (|goal attributes| + |goal options| + 1)``

* ``r_type`` (product type): 1.0, lowered to 0.5 when neither the scrape query, nor the
  category path (at least two shared ``›``-separated levels), nor the title (noun
  overlap above 0.2) matches; to 0.1 when the noun overlap is below 0.1; and to 0.0 when
  it is 0. The noun overlap is ``|nouns(purchased) ∩ nouns(goal)| / |nouns(goal)|``
  (0.2 when the goal title has no nouns). WebShop takes the nouns with spaCy; our
  catalogue stores each product's title nouns (``product["nouns"]``), written by the
  generator, so no tagger is needed.
* ``n_att``: goal attributes matched by a product attribute (fuzzy, see
  :mod:`.fuzzy`) or, failing that, found verbatim in the lower-cased title, features
  or description.
* ``n_opt`` (``get_option_reward``): counted over the *chosen* (purchased) options. Both
  the chosen values and the goal values first go through colour normalisation. A chosen
  value counts when its dimension is ``size`` (any case) and it equals one of the goal
  values exactly; for any other dimension, when it matches one of the goal values
  fuzzily; and, failing that (size included), when it occurs verbatim in the lower-cased
  title, features or description. ``r_option = n_opt / |goal options|`` (None when the
  goal has none); as in WebShop, ``n_opt`` can exceed the number of goal options when
  more options are chosen than the goal names.
* ``r_price``: 1 when the price is at most the goal's cap.

The purchase is a success (``won``) when the reward is exactly 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Sequence

from .fuzzy import fuzzy_match, normalize_color

__all__ = ["RewardInfo", "type_reward", "attribute_reward", "option_reward", "webshop_reward", "EXACT_MATCH_OPTIONS"]

CATEGORY_SEP = "›"
#: Option dimensions matched exactly rather than fuzzily (WebShop's ``EXACT_MATCH_OPTS``).
EXACT_MATCH_OPTIONS = ("size",)


@dataclass(frozen=True)
class RewardInfo:
    """The reward and its parts, as WebShop's ``verbose=True`` reports them."""

    reward: float
    r_type: float
    r_att: float
    r_option: float | None
    r_price: float
    num_attr_matches: int
    num_option_matches: int
    query_match: bool
    category_match: bool
    title_score: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _category_levels(path: str) -> set[str]:
    return {x.strip() for x in path.split(CATEGORY_SEP)}


def type_reward(purchased: Mapping[str, Any], goal: Mapping[str, Any]) -> dict[str, Any]:
    """``r_type`` with its three signals (query, category path, title nouns)."""
    query_match = purchased["query"] == goal["query"]
    category_match = (
        len(_category_levels(purchased["product_category"]) & _category_levels(goal["product_category"])) >= 2
    )
    desired = {n.lower() for n in goal["nouns"]}
    bought = {n.lower() for n in purchased["nouns"]}
    title_score = 0.2 if not desired else len(bought & desired) / len(desired)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {
        "r_type": r_type,
        "query_match": query_match,
        "category_match": category_match,
        "title_score": title_score,
    }


def attribute_reward(purchased: Mapping[str, Any], goal_attributes: Sequence[str]) -> tuple[float, int]:
    """(fraction, count) of goal attributes the purchased product has."""
    product_attrs = purchased["attributes"]
    title = purchased["title"].lower()
    features = " ".join(purchased["features"]).lower()
    description = purchased["description"].lower()
    matches = 0
    for g_attr in goal_attributes:
        if any(fuzzy_match(p_attr, g_attr) for p_attr in product_attrs):
            matches += 1
        elif g_attr in title or g_attr in features or g_attr in description:
            matches += 1
    # WebShop divides by len(goal attributes) unguarded; goals here always have >= 1.
    fraction = matches / len(goal_attributes) if goal_attributes else 0.0
    return fraction, matches


def option_reward(purchased: Mapping[str, Any], goal_options: Iterable[str],
                  chosen_options: Mapping[str, str]) -> tuple[float | None, int]:
    """(fraction or None when the goal has no options, count): WebShop's ``get_option_reward``.

    ``chosen_options`` maps each chosen dimension to its value (what was clicked before
    buying); ``purchased`` supplies the title, features and description searched when a
    chosen value matches no goal value.
    """
    goal_n = [normalize_color(o) for o in goal_options]
    title = purchased["title"].lower()
    features = " ".join(purchased["features"]).lower()
    description = purchased["description"].lower()
    matches = 0
    for dim, value in chosen_options.items():
        v = normalize_color(value)
        if dim.lower() in EXACT_MATCH_OPTIONS:
            matched = v in goal_n
        else:
            matched = any(fuzzy_match(g_opt, v) for g_opt in goal_n)
        if not matched:
            matched = v in title or v in features or v in description
        matches += int(matched)
    fraction = matches / len(goal_n) if goal_n else None
    return fraction, matches


def webshop_reward(
    purchased: Mapping[str, Any],
    goal: Mapping[str, Any],
    price: float,
    chosen_options: Mapping[str, str],
) -> RewardInfo:
    """WebShop's ``get_reward`` for buying ``purchased`` at ``price`` with ``chosen_options``.

    ``goal`` needs ``query``, ``product_category``, ``nouns``, ``attributes``,
    ``goal_options`` (a mapping name -> value; only the values are matched, as in
    WebShop's human goals) and ``price_upper``.
    """
    t = type_reward(purchased, goal)
    goal_attrs = list(goal["attributes"])
    goal_opts = list(goal["goal_options"].values())
    r_price = 1.0 if price <= goal["price_upper"] else 0.0
    r_att, n_att = attribute_reward(purchased, goal_attrs)
    r_opt, n_opt = option_reward(purchased, goal_opts, chosen_options)
    total = (n_att + n_opt + r_price) / (len(goal_attrs) + len(goal_opts) + 1)
    total *= t["r_type"]
    return RewardInfo(
        reward=total,
        r_type=t["r_type"],
        r_att=r_att,
        r_option=r_opt,
        r_price=r_price,
        num_attr_matches=n_att,
        num_option_matches=n_opt,
        query_match=t["query_match"],
        category_match=t["category_match"],
        title_score=t["title_score"],
    )
