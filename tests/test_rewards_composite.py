"""The registry and the composite reward: spec parsing, None handling, requires, start-up validation."""

from __future__ import annotations

import dataclasses

import pytest

import rewards
from rewards import Grader, Mix, RewardConfig, Sample, build_reward
from rewards.base import combine
from rewards.spec import parse_spec


class Fixed(Grader):
    """A grader returning given scores, to test the composition alone."""

    def __init__(self, name, scores, requires=()):
        self.name, self.scores, self.requires = name, scores, requires
        self.prepared = None

    def score(self, batch):
        return list(self.scores)

    def prepare(self, rows):
        self.prepared = rows


def batch(n):
    return [Sample("p", "c", 0, {}) for _ in range(n)]


def test_parse_spec():
    assert parse_spec("judge:0.6, concepts:0.3,consistency:0.1") == [
        ("judge", 0.6),
        ("concepts", 0.3),
        ("consistency", 0.1),
    ]
    assert parse_spec("rouge_l") == [("rouge_l", 1.0)]
    assert parse_spec("judge+numbers:1,") == [("judge+numbers", 1.0)]
    for bad, msg in [("a:x", "not a number"), ("a:-1", ">= 0"), ("a:1,a:2", "twice"), ("", "names nothing"),
                     ("a:0", "sum to 0"), ("a:nan", ">= 0")]:  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            parse_spec(bad)


def test_unknown_grader_lists_the_known_ones():
    with pytest.raises(ValueError) as e:
        build_reward(RewardConfig(spec="rouge_l:1,bleu:1"))
    msg = str(e.value)
    assert "'bleu'" in msg and all(
        n in msg for n in ["rouge_l", "numbers", "semantic", "concepts", "keywords", "style"]
    )
    with pytest.raises(ValueError, match="known"):
        build_reward(RewardConfig(spec=" "))


def test_every_grader_is_registered():
    want = {"exact", "contains", "label", "json", "format", "think", "rouge_l", "numbers", "semantic"}
    want |= {"consistency", "concepts", "keywords", "style"}
    assert want <= set(rewards.known())


@pytest.mark.parametrize(
    "scores, weights, want",
    [
        ([0.5, 1.0], [1, 1], 1.5),  # Shaping Explanations: an unweighted sum
        ([0.5, None], [1, 1], 1.0),  # b drops out; a's weight scales up to the total 2
        ([0.2, 0.8, 1.0], [0.6, 0.3, 0.1], 0.12 + 0.24 + 0.1),
        ([None, 0.8, 1.0], [0.6, 0.3, 0.1], (0.24 + 0.1) / 0.4),  # weighted mean of the rest
        ([None, None], [1, 1], None),  # nothing applies
        ([0.3, 0.9], [1, 0], 0.3),  # weight 0: logged, not rewarded
        ([None, 0.9], [1, 0], None),
    ],
)
def test_combine(scores, weights, want):
    got = combine(scores, weights)
    assert got == pytest.approx(want) if want is not None else got is None


def test_reward_function_components_and_none():
    fn = rewards.RewardFunction(
        {"a": Fixed("a", [1.0, None, None]), "b": Fixed("b", [0.0, 0.5, None])}, {"a": 0.75, "b": 0.25}
    )
    r, comps = fn(batch(3))
    assert r == [pytest.approx(0.75), pytest.approx(0.5), None]
    assert comps == {"a": [1.0, None, None], "b": [0.0, 0.5, None]}


def test_base_grader_clips_and_maps_nan_to_none():
    # a NaN is no score: None, never a measured 0 that would enter its group as a reward
    assert Fixed("x", [1.5, -0.2, float("nan"), None, 0.3])(batch(5)) == [1.0, 0.0, None, None, 0.3]


def test_mix_renormalises_or_propagates_none():
    a, b = Fixed("a", [1.0, 0.5, None]), Fixed("b", [0.0, None, None])
    assert Mix("a+b", [(a, 0.5), (b, 0.5)])(batch(3)) == [0.5, 0.5, None]
    assert Mix("a+b", [(a, 0.5), (b, 0.5)], on_none="none")(batch(3)) == [0.5, None, None]


def test_requires_and_validate_name_file_line_field():
    fn = build_reward(RewardConfig(spec="rouge_l:0.5,keywords:0.3,exact:0.2"))
    assert set(fn.requires) == {"reference", "key_points", "answer"}
    good = {"reference": "r", "key_points": [["r"]], "answer": "B"}
    fn.validate([good, good], "train.jsonl")
    cases = [
        ({"key_points": [["r"]], "answer": "B"}, "field 'reference' is missing"),
        ({**good, "reference": 3}, "field 'reference' must be a string"),
        ({**good, "key_points": "r"}, "field 'key_points' must be a non-empty list"),
        ({**good, "answer": {"x": 1}}, "field 'answer' must be a string or a number"),
    ]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=f"train.jsonl:2: {msg}") as e:
            fn.validate([good, bad], "train.jsonl")
        assert "grader '" in str(e.value)
    with pytest.raises(ValueError, match="data.jsonl:17: field 'reference'"):
        fn.validate([{**good, "_line": 3}, {"_line": 17}], "data.jsonl")  # the loader's line numbers win


def test_label_requires_depends_on_flags():
    assert build_reward(RewardConfig(spec="label")).requires == ("labels",)
    assert build_reward(RewardConfig(spec="label", labels=("yes", "no"))).requires == ()


def test_validate_hands_rows_to_prepare():
    g = Fixed("a", [1.0])
    fn = rewards.RewardFunction({"a": g}, {"a": 1.0})
    rows = [{"reference": "x"}]
    fn.validate(rows, "f")
    assert g.prepared == rows


def test_bad_flags_are_value_errors():
    cfg = RewardConfig()
    for spec, opts, msg in [
        ("exact", {"normalize": ("case", "stem")}, "unknown steps"),
        ("exact", {"answer_regex": "(unclosed"}, "does not compile"),
        ("format", {"format_tags": ()}, "format-tags is empty"),
        ("format", {"format_tags": ("a", "a")}, "repeats"),
        ("consistency", {"consistency_n": 0}, "consistency-n"),
        ("concepts", {"concepts_backend": "umls"}, "concepts-backend"),
        ("concepts", {"concepts_vocab": "/no/such/file.tsv"}, "no such file"),
        ("style", {"style_weights": "length:-1"}, "style-weights"),
        ("semantic", {"semantic_baseline_samples": 0}, "baseline-samples"),
    ]:
        with pytest.raises(ValueError, match=msg):
            build_reward(dataclasses.replace(cfg, spec=spec, **opts))


def test_details_of_the_last_call():
    g = Fixed("judge", [1.0, 0.0])
    g.last_details = [{"reason": "right"}, None]
    fn = rewards.RewardFunction(
        {"judge+similarity": g, "b": Fixed("b", [0.5, 0.5])}, {"judge+similarity": 1, "b": 1}
    )
    assert fn.details() == {}  # nothing called yet
    fn(batch(2))
    assert fn.details() == {"judge": [{"reason": "right"}, None]}
