"""Table-driven tests of the rule-based graders: the guide's worked examples, the traps, the edge rules."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from rewards import RewardConfig, Sample, make
from rewards.text import canonical, figures, normalize, strip_think, tag_content

CFG = RewardConfig()


def grade(name: str, completion: str, row: dict | None = None, **opts) -> float | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the demo-vocabulary warning of concepts
        g = make(name, dataclasses.replace(CFG, **opts))
    return g([Sample("prompt", completion, 0, row or {})])[0]


# ----------------------------------------------------------------------------- guide 001: ROUGE-L

SHARE = "Open the report, click Share and pick the client."


@pytest.mark.parametrize(
    "answer, want",
    [
        ("Click Share on the report and pick the client.", 0.67),  # A: LCS 6 of 9 and 9
        ("Use the Share button in your report to send it to them.", 0.19),  # B: correct, reworded
        ("Open the report, click Share and pick the admin.", 0.89),  # C: wrong recipient
        (SHARE, 1.0),
        ("", 0.0),
        ("<think>Open the report, click Share and pick the client.</think>nothing", 0.0),  # think ignored
    ],
)
def test_rouge_l_worked_examples(answer, want):
    assert round(grade("rouge_l", answer, {"reference": SHARE}), 2) == want


def test_rouge_l_trap_wrong_answer_in_the_references_words_wins():
    # the guide's warning: similarity measures wording, so the wrong answer C beats the paraphrase B
    ref = {"reference": "Water boils at 100 degrees Celsius at sea level."}
    paraphrase = grade("rouge_l", "At sea level, H2O reaches its boiling point at 100°C.", ref)
    wrong = grade("rouge_l", "Water freezes at 0 degrees Celsius at sea level.", ref)
    assert wrong > 2 * paraphrase


def test_rouge_l_none_without_reference_words_and_text_tag():
    assert grade("rouge_l", "anything", {"reference": "  ...  "}) is None
    row = {"reference": "pick the client"}
    assert (
        grade("rouge_l", "<spiegazione>pick the client</spiegazione> junk", row, text_tag="spiegazione")
        == 1.0
    )
    assert grade("rouge_l", "pick the client", row, text_tag="spiegazione") == 0.0  # tag missing


def test_rouge_l_matches_rouge_score_package_on_ascii():
    rouge_score = pytest.importorskip("rouge_score.rouge_scorer")
    from rewards.rouge import rouge_l

    scorer = rouge_score.RougeScorer(["rougeL"], use_stemmer=False)
    pairs = [
        ("the cat sat on the mat", "the cat lay on a mat"),
        ("a b c d e f", "f e d c b a"),
        (SHARE, "Use the Share button in your report to send it to them."),
    ]
    ours = rouge_l([b for _, b in pairs], [a for a, _ in pairs])
    for (ref, ans), got in zip(pairs, ours):
        assert got == pytest.approx(scorer.score(ref, ans)["rougeL"].fmeasure)


# ----------------------------------------------------------------------------- guide 001: numbers

WACC = "WACC ≈ 9.91%; cost of equity 10.34%; after-tax debt 4.15%; EV ≈ $1,705M."


@pytest.mark.parametrize(
    "answer, reference, want",
    [
        (
            "WACC 9.95%, cost of equity 10.3%, after-tax debt 4.2%, EV $1,700M.",
            WACC,
            0.875,
        ),  # the worked example
        ("WACC is 1.33%", WACC, 0.0),
        (
            "The WACC is about ten percent.",
            "The WACC is roughly what the market expects.",
            None,
        ),  # no figures
        ("no figures at all", WACC, 0.0),
        ("EV is 1.705B", "EV ≈ $1,705M", 1.0),  # units aligned
        ("EV is 1705 million", "EV ≈ $1,705M", 1.0),
        ("EV is 1705", "EV ≈ $1,705M", 0.0),  # 1705 is not 1.705 billion
        ("margin 8.3", "margin 8.5%", 0.5),  # 2.4% off: half credit; '%' alone is not an error
        ("margin 9", "margin 8.5%", 0.0),  # 5.9% off
        ("1. Growth 12%.\n2. Margin 8%.", "Growth 12%, margin 8%.", 1.0),
        (
            "Growth 3% and margin 4%.",
            "1. Growth 12%\n2. Margin 8%\n3. Debt 2.5x",
            0.0,
        ),  # list numbers are not figures
        ("loss of -3.5%", "a loss of −3.5%", 1.0),  # unicode minus
        ("loss of 3.5%", "a loss of -3.5%", 0.0),  # the sign counts
        ("costo 9,91%", "costo 9.91%", 1.0),  # decimal comma
        ("value 0", "value 0", 1.0),
        ("value 0.001", "value 0", 0.0),
    ],
)
def test_numbers(answer, reference, want):
    assert grade("numbers", answer, {"reference": reference}) == want


def test_numbers_list_numbering_is_ignored():
    ref = "1. Revenue rose 12%\n2. Costs fell 3%\n3) Profit 40 million"
    assert [canonical(f.value, f.percent) for f in figures(ref)] == ["12%", "3%", "40000000"]
    # an answer numbered 1., 2., 3. does not earn credit for figures 1, 2, 3 of a reference
    ref2 = "Tolerances: 1, 2 and 3 mm."
    assert grade("numbers", "1. first\n2. second\n3. third", {"reference": ref2}) == 0.0


def test_numbers_tolerances_are_flags():
    row = {"reference": "rate 10%"}
    assert grade("numbers", "rate 10.4%", row) == 0.5
    assert grade("numbers", "rate 10.4%", row, numbers_full=0.05) == 1.0
    with pytest.raises(ValueError, match="numbers-full"):
        grade("numbers", "x", row, numbers_full=0.1, numbers_half=0.05)


# ----------------------------------------------------------------------------- exact, contains, label, json


@pytest.mark.parametrize(
    "name, completion, row, opts, want",
    [
        ("exact", "<answer>B</answer>", {"answer": "B"}, {}, 1.0),
        ("exact", "<answer> b. </answer>", {"answer": "B"}, {}, 1.0),  # case, space, punctuation
        ("exact", "<answer>C</answer>", {"answer": "B"}, {}, 0.0),
        ("exact", "<answer>1,000</answer>", {"answer": 1000}, {}, 1.0),  # numbers
        ("exact", "<answer>1000.0</answer>", {"answer": "1,000"}, {}, 1.0),
        ("exact", "<answer>-5</answer>", {"answer": "5"}, {}, 0.0),  # the sign survives punctuation removal
        ("exact", "<answer>1,000</answer>", {"answer": "1000"}, {"normalize": ("case",)}, 0.0),
        (
            "exact",
            "<risposta>B</risposta>",
            {"answer": "B"},
            {"answer_tag": "risposta"},
            1.0,
        ),  # Shaping Explanations
        ("exact", "<answer>A</answer> then <answer>B</answer>", {"answer": "B"}, {}, 1.0),  # the last one
        ("exact", "B", {"answer": "B"}, {}, 1.0),  # no tag: the whole completion
        ("exact", "B", {"answer": "B"}, {"answer_strict": True}, 0.0),
        ("exact", "<think>B?</think>B", {"answer": "B"}, {}, 1.0),
        ("exact", "The answer is: 42.", {"answer": "42"}, {"answer_regex": r"answer is:?\s*(\S+)"}, 1.0),
        ("exact", "Ça va", {"answer": "ça VA"}, {}, 1.0),
        ("contains", "<answer>It is B, clearly</answer>", {"answer": "B"}, {}, 1.0),
        ("contains", "<answer>But C</answer>", {"answer": "B"}, {}, 0.0),  # word boundaries
        ("contains", "the capital is paris.", {"answer": "Paris"}, {}, 1.0),
        ("label", "<answer>Maybe</answer>", {"labels": ["yes", "no", "maybe"]}, {}, 1.0),
        ("label", "<answer>perhaps</answer>", {"labels": ["yes", "no", "maybe"]}, {}, 0.0),
        ("label", "<answer>no</answer>", {}, {"labels": ("yes", "no")}, 1.0),
        ("json", '{"a": 1}', {}, {}, 1.0),
        ("json", '```json\n{"a": 1, "b": 2}\n```', {}, {"json_keys": ("a", "b")}, 1.0),
        ("json", '{"a": 1}', {}, {"json_keys": ("a", "b")}, 0.0),
        ("json", "[1, 2]", {}, {"json_keys": ("a",)}, 0.0),
        ("json", "{'a': 1}", {}, {}, 0.0),
        ("json", "[" * 100_000, {}, {}, 0.0),
        ("json", '<answer>{"a": 1}</answer>', {}, {}, 1.0),
    ],
)
def test_answer_graders(name, completion, row, opts, want):
    assert grade(name, completion, row, **opts) == want


def test_answer_graders_none_without_the_field():
    assert grade("exact", "B", {}) is None
    assert grade("label", "B", {}) is None


def test_normalize_and_tags():
    assert normalize("The answer is  1,000 dollars!") == "the answer is 1000 dollars"
    assert normalize("1.705.000,5") == normalize("1,705,000.5") == "1705000.5"
    assert tag_content("<a>x</a><a>y", "a") == "x"
    assert tag_content("</a><a>", "a") is None
    assert strip_think("<think>a</think>b<think>c</think>d").split() == ["b", "d"]
    assert strip_think("reasoning opened in the prompt</think>the reply") == "the reply"


# ----------------------------------------------------------------------------- format, think


@pytest.mark.parametrize(
    "completion, tags, want",
    [
        ("<think>x</think><answer>B</answer>", ("think", "answer"), 1.0),
        ("intro <think>x</think>\n<answer>B</answer> outro", ("think", "answer"), 1.0),
        ("<answer>B</answer><think>x</think>", ("think", "answer"), 0.0),  # order
        ("<think>x<answer>B</answer></think>", ("think", "answer"), 0.0),  # nested
        ("<think>x</think><answer>B", ("think", "answer"), 0.0),  # unclosed
        ("<think>x</think><answer>B</answer><answer>C</answer>", ("think", "answer"), 0.0),  # twice
        ("x</think><answer>B</answer>", ("think", "answer"), 1.0),  # think opened by the chat template
        (
            "<spiegazione>e</spiegazione><risposta>B</risposta>",
            ("spiegazione", "risposta"),
            1.0,
        ),  # Shaping Explanations
        ("<THINK>x</THINK><Answer>B</Answer>", ("think", "answer"), 1.0),
        ("", ("think", "answer"), 0.0),
    ],
)
def test_format(completion, tags, want):
    assert grade("format", completion, format_tags=tags) == want


@pytest.mark.parametrize(
    "completion, want",
    [
        ("<think>because</think>B", 1.0),
        ("<think> \n </think>B", 0.0),
        ("B", 0.0),
        ("because</think>B", 1.0),
        ("<think>open", 0.0),
    ],
)
def test_think(completion, want):
    assert grade("think", completion) == want


# ----------------------------------------------------------------------------- consistency


@pytest.mark.parametrize(
    "completion, n, want",
    [
        ("the cat sat on the mat", 3, 1.0),
        ("a b c a b c", 3, 3 / 4),  # 4 trigrams, 'a b c' repeats once
        ("go go go go go", 1, 1 / 5),
        ("go go go go go", 3, 1 / 3),
        ("short", 3, 1.0),
        ("", 3, 0.0),
        ("!!!!!!!!", 3, 0.0),
    ],
)
def test_consistency(completion, n, want):
    assert grade("consistency", completion, consistency_n=n) == pytest.approx(want)


# ----------------------------------------------------------------------------- concepts (Concept Overlap)

HEPARIN = {"reference": "Start heparin immediately."}


@pytest.mark.parametrize(
    "completion, row, want",
    [
        ("Give heparin now.", HEPARIN, 1.0),
        ("Give warfarin now.", HEPARIN, 0.0),  # the paper's trap: one substituted entity
        ("Give an anticoagulant now.", HEPARIN, 0.0),  # the drug class is not the drug
        ("Give unfractionated heparin.", HEPARIN, 1.0),  # longest match, same id
        ("Heparin; check platelets.", HEPARIN, 2 / 3),  # an extra concept costs precision
        ("He had a heart-attack.", {"reference": "Myocardial infarction (MI)."}, 1.0),  # synonyms collapse
        ("type 2 diabetes mellitus", {"reference": "diabetes"}, 0.0),  # longest match: a different concept
        ("anything", {"reference": "The report is due Friday."}, None),  # no concept in the reference
        ("", HEPARIN, 0.0),
    ],
)
def test_concepts_demo_vocabulary(completion, row, want):
    assert grade("concepts", completion, row) == pytest.approx(want)


def test_concepts_vocabulary_files(tmp_path):
    tsv = tmp_path / "v.tsv"
    tsv.write_text(
        "# comment\nterm\tid\nacetaminophen\tC1\nparacetamol\tC1\nibuprofen\tC2\n", encoding="utf-8"
    )
    js = tmp_path / "v.json"
    js.write_text('{"C1": ["acetaminophen", "paracetamol"], "C2": ["ibuprofen"]}', encoding="utf-8")
    for path in (tsv, js):
        assert (
            grade("concepts", "Paracetamol", {"reference": "acetaminophen"}, concepts_vocab=str(path)) == 1.0
        )
        assert grade("concepts", "ibuprofen", {"reference": "acetaminophen"}, concepts_vocab=str(path)) == 0.0
    bad = tmp_path / "bad.tsv"
    bad.write_text("aspirin\tC1\nno tab here\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.tsv:2"):
        grade("concepts", "x", HEPARIN, concepts_vocab=str(bad))
    with pytest.raises(ValueError, match="scispacy"):
        grade("concepts", "x", HEPARIN, concepts_backend="scispacy")


# ----------------------------------------------------------------------------- keywords (RLVRR)

REF = "First stop warfarin, then give vitamin K, and finally check the INR."
KP = {"reference": REF, "key_points": [["warfarin", "vitamin K", "INR"]]}


@pytest.mark.parametrize(
    "completion, row, want",
    [
        ("Stop warfarin, give vitamin K, recheck INR.", KP, 1.0),
        ("Check INR, give vitamin K, stop warfarin.", KP, 1 / 3),  # all there, order reversed: LCS 1 of 3
        ("Stop warfarin and check INR.", KP, 2 / 3),
        ("Nothing relevant.", KP, 0.0),
        (
            "Stop warfarin, give vitamin K.",
            {**KP, "key_points": [["warfarin", "vitamin k"], ["INR"]]},
            0.5,
        ),  # mean
        # the listed order does not matter: the reference fixes it
        (
            "Stop warfarin, give vitamin K, recheck INR.",
            {**KP, "key_points": [["INR", "vitamin K", "warfarin"]]},
            1.0,
        ),
        # max over references: the second reference orders the keywords the way the answer does
        (
            "Check INR, then warfarin.",
            {**KP, "key_points": [["warfarin", "INR"]], "references": ["INR first, warfarin next."]},
            1.0,
        ),
        (
            "Check INR, then warfarin.",
            {"key_points": [["warfarin", "INR"]]},
            0.5,
        ),  # no reference: listed order
        ("anything", {"reference": REF, "key_points": [[], [""]]}, None),
    ],
)
def test_keywords(completion, row, want):
    assert grade("keywords", completion, row) == pytest.approx(want)


# ----------------------------------------------------------------------------- style (RLVRR)

MD_REF = "# Plan\n\n- stop **warfarin**\n- give vitamin K\n\n```\ncheck INR\n```\n"


@pytest.mark.parametrize(
    "completion, reference, weights, want",
    [
        (MD_REF, MD_REF, "length:1,headings:1,lists:1,emphasis:1,code:1", 1.0),
        ("stop warfarin give vitamin K and check INR", MD_REF, "headings:1,lists:1,emphasis:1,code:1", 0.0),
        ("plain prose here", "plain prose there", "headings:1,lists:1,emphasis:1,code:1,tables:1", 1.0),
        ("# Title\nplain", "plain prose", "headings:1", 0.0),
        ("a b c d", "a b c d", "length:1", 1.0),
        ("a b c d e f", "a b c d", "length:1", 1.0),  # 1.5x: within the tolerance
        ("a b c d e f g h i j k l", "a b c d", "length:1", 0.5),  # 3x: 1.5 / 3
        ("a", "a b c d", "length:1", 0.375),  # 0.25x: 0.25 * 1.5
        ("| a | b |\n|---|---|\n| 1 | 2 |", "| x | y |\n| --- | --- |", "tables:1", 1.0),
        ("- item\n- item", "1. step\n2. step", "lists:2,emphasis:1", 1.0),
    ],
)
def test_style(completion, reference, weights, want):
    assert grade("style", completion, {"reference": reference}, style_weights=weights) == pytest.approx(want)


def test_style_weights_and_user_checks():
    row = {"reference": "- a list"}
    # lists wrong (0, weight 3), length fine (1, weight 1): 1/4
    assert grade("style", "prose", row, style_weights="lists:3,length:1", style_length_tolerance=9) == 0.25
    with pytest.raises(ValueError, match="allow-user-code"):
        grade("style", "x", row, style_user_checks=("tests.style_checks.mentions_reference",))
    with pytest.raises(ValueError, match="unknown checks"):
        grade("style", "x", row, style_weights="sparkle:1")
    with pytest.raises(ValueError, match="cannot import"):
        grade("style", "x", row, style_user_checks=("no_such_module.f",), style_allow_user_code=True)


def test_style_user_check_runs_and_errors_score_zero(tmp_path, monkeypatch):
    from rewards.style import Style

    (tmp_path / "my_checks.py").write_text(
        "def ends_with_period(completion, reference, row):\n"
        "    return completion.rstrip().endswith('.')\n"
        "def broken(completion, reference, row):\n"
        "    raise RuntimeError('a bug in the check')\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = dataclasses.replace(
        CFG,
        style_weights="lists:1,ends_with_period:2",
        style_user_checks=("my_checks.ends_with_period", "my_checks.broken"),
        style_allow_user_code=True,
    )
    g = Style(cfg)
    row = {"reference": "plain."}
    # lists 1 (weight 1), period 1 (weight 2), broken 0 (weight 1): 3/4
    assert g([Sample("p", "plain answer.", 0, row)]) == [pytest.approx(3 / 4)]
    assert g([Sample("p", "plain answer", 0, row)]) == [pytest.approx(1 / 4)]
    assert g.metrics() == {"user_check_errors": 2.0}
