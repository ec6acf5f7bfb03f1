"""The concepts grader's scispaCy backend (Concept Overlap) against a stand-in for scispaCy and its UMLS linker.

The real backend needs scispacy, a scispaCy model and the linker's ~1 GB knowledge base, none of which
the tests install (docs/GRADERS.md). The stand-in mimics what the adapter calls: `spacy.load(name)`,
`nlp.add_pipe(name, config=...)`, `nlp.pipe(texts)`, `doc.ents` and each entity's `._.kb_ents`, the
linker's (CUI, score) candidates above its threshold, best first.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from rewards import RewardConfig, Sample, make
from rewards.concepts import _SciSpacy

MI, HEART, HEPARIN, WARFARIN = "C0027051", "C0018787", "C0019134", "C0043031"
# what the stand-in linker says for each mention it recognises
CANDIDATES = {
    "myocardial infarction": [(MI, 0.99)],
    "heart attack": [(MI, 0.93), (HEART, 0.71)],  # the synonym's top candidate is MI, not 'heart'
    "heparin": [(HEPARIN, 1.0)],
    "warfarin": [(WARFARIN, 1.0)],
    "patient": [],  # an entity every candidate of which fell below the linker's threshold
}


class StandInNLP:
    """A spaCy Language with a 'NER' that finds the mentions of CANDIDATES (case-folded, in order) and a
    'linker' that sets their kb_ents."""

    max_length = 1_000_000

    def __init__(self, name: str):
        self.name, self.pipes, self.calls = name, [], []

    def add_pipe(self, name: str, config: dict | None = None) -> None:
        if name == "scispacy_linker" and FAIL_LINKER:
            raise ConnectionError("HEAD request failed")  # requests' ConnectionError is an OSError
        self.pipes.append((name, config or {}))

    def pipe(self, texts):
        self.calls.append(list(texts))
        assert [n for n, _ in self.pipes] == ["abbreviation_detector", "scispacy_linker"]
        for text in self.calls[-1]:
            assert len(text) <= self.max_length  # spaCy raises E088 on longer texts
            low = text.lower()
            found = sorted((low.find(m), m) for m in CANDIDATES if m in low)
            ents = [SimpleNamespace(text=m, _=SimpleNamespace(kb_ents=list(CANDIDATES[m]))) for _, m in found]
            yield SimpleNamespace(ents=ents)


FAIL_LINKER = False
LOADED: list[StandInNLP] = []


def load(name: str) -> StandInNLP:
    if name != "en_core_sci_sm":
        raise OSError(f"[E050] Can't find model '{name}'.")
    LOADED.append(StandInNLP(name))
    return LOADED[-1]


@pytest.fixture
def scispacy(monkeypatch):
    """Fake `spacy` and `scispacy` modules in sys.modules for the duration of a test."""
    global FAIL_LINKER
    FAIL_LINKER = False
    LOADED.clear()
    spacy = types.ModuleType("spacy")
    spacy.load = load
    package = types.ModuleType("scispacy")
    package.__path__ = []  # a package, so `import scispacy.linking` looks up the submodules below
    for name, module in {
        "spacy": spacy,
        "scispacy": package,
        "scispacy.linking": types.ModuleType("scispacy.linking"),
        "scispacy.abbreviation": types.ModuleType("scispacy.abbreviation"),
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield
    FAIL_LINKER = False


def test_the_adapter_builds_seed_002s_pipeline_and_takes_each_entitys_top_cui(scispacy):
    ext = _SciSpacy("en_core_sci_sm")
    nlp = LOADED[-1]
    assert nlp.pipes == [
        ("abbreviation_detector", {}),  # what resolve_abbreviations reads
        ("scispacy_linker", {"resolve_abbreviations": True, "linker_name": "umls"}),
    ]
    got = ext.batch(
        [
            "Heparin after a myocardial infarction.",
            "A heart attack, then warfarin.",
            "The patient is well.",
            "",
        ]
    )
    assert got == [{HEPARIN, MI}, {MI, WARFARIN}, set(), set()]
    assert len(nlp.calls) == 1  # one nlp.pipe over the batch


def test_the_grader_scores_set_f1_of_the_linked_cuis(scispacy):
    grader = make("concepts", RewardConfig(concepts_backend="scispacy"))
    ref = {"reference": "Start heparin for the myocardial infarction."}  # {HEPARIN, MI}
    batch = [
        Sample("p", "Heparin, since it is a heart attack.", 0, ref),  # synonym: the same CUIs -> 1
        Sample("p", "Warfarin for the heart attack.", 0, ref),  # {WARFARIN, MI}: 2*1 / (2+2)
        Sample("p", "Heparin.", 0, ref),  # {HEPARIN}: 2*1 / (1+2)
        Sample("p", "<think>heparin, myocardial infarction</think>The patient rests.", 0, ref),  # no CUI
        Sample("p", "Heparin.", 1, {"reference": "The patient rests."}),  # the reference names none
    ]
    assert grader(batch) == pytest.approx([1.0, 0.5, 2 / 3, 0.0, None])
    nlp = LOADED[-1]
    grader(batch)  # the references' CUIs are cached: only the answers go through the pipeline again
    assert [len(c) for c in nlp.calls] == [2, 5, 5]


def test_a_text_past_spacys_limit_is_cut_not_raised(scispacy):
    ext = _SciSpacy("en_core_sci_sm")
    assert ext.batch(["heparin " + "x" * 2_000_000]) == [{HEPARIN}]


def test_what_is_missing_is_named_with_the_fix(scispacy, monkeypatch):
    global FAIL_LINKER
    with pytest.raises(ValueError, match=r"concepts-scispacy-model 'en_core_sci_lg' does not load.*README"):
        make("concepts", RewardConfig(concepts_backend="scispacy", concepts_scispacy_model="en_core_sci_lg"))
    FAIL_LINKER = True
    with pytest.raises(ValueError, match=r"knowledge base.*about 1 GB.*concepts-backend vocab"):
        _SciSpacy("en_core_sci_sm")
    monkeypatch.setitem(sys.modules, "scispacy", None)  # not installed: the import fails
    with pytest.raises(ValueError, match=r"pip install scispacy.*not on PyPI"):
        _SciSpacy("en_core_sci_sm")
