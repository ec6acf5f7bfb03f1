"""The concepts grader of Concept Overlap: set F1 of the concept ids named by the answer and the reference.

    score = 2 |C_gen ∩ C_ref| / (|C_gen| + |C_ref|)

C is the set of concept ids found in a text. Concept Overlap finds UMLS CUIs with scispaCy's entity linker;
nanogrpo's default finds them with a controlled vocabulary file (term -> id), which needs no model
and no download and is exactly reproducible:

- case-folded, on word boundaries (the text and the terms are split into \\w+ words the same way, so
  'Heart-attack' matches the term 'heart attack');
- longest match first, left to right: 'type 2 diabetes mellitus' is one concept, not also 'diabetes';
- synonyms collapse: every term of one id counts as the same concept ('heart attack', 'myocardial
  infarction' and 'MI'), while distinct entities stay apart ('heparin' vs 'warfarin').

None when the reference names no concept (the row is skipped); an answer that names none scores 0.
The vocabulary is --reward.concepts-vocab: TSV ('term<TAB>id', '#' comments, an optional 'term id'
header, extra columns ignored) or JSON ({"term": "id"} or {"id": ["term", ...]}); the first id given
to a term wins. Without one, a small hand-written DEMO vocabulary (rewards/data/demo_concepts.tsv,
not UMLS) is used, with a warning. --reward.concepts-backend scispacy runs Concept Overlap's pipeline when
scispacy, a scispaCy model and the UMLS linker's data are installed (optional, not a dependency of
nanogrpo; the model and the ~1 GB linker data come from scispaCy's own server, not from PyPI).
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

from rewards.base import Grader, Sample, check_text_field
from rewards.options import RewardConfig
from rewards.registry import register
from rewards.text import reply_text, words

DEMO_VOCAB = Path(__file__).parent / "data" / "demo_concepts.tsv"


class Vocabulary:
    """Term -> concept id, matched longest first on case-folded words."""

    def __init__(self, pairs: list[tuple[str, str]]):
        self.terms: dict[tuple[str, ...], str] = {}
        self.longest: dict[str, int] = {}  # first word -> longest term starting with it
        for term, cid in pairs:
            key = tuple(words(term))
            if key and key not in self.terms:
                self.terms[key] = cid
                self.longest[key[0]] = max(self.longest.get(key[0], 0), len(key))

    def __len__(self) -> int:
        return len(self.terms)

    def concepts(self, text: str) -> set[str]:
        toks = words(text)
        found: set[str] = set()
        i = 0
        while i < len(toks):
            step = 1
            for n in range(min(self.longest.get(toks[i], 0), len(toks) - i), 0, -1):
                cid = self.terms.get(tuple(toks[i : i + n]))
                if cid is not None:
                    found.add(cid)
                    step = n
                    break
            i += step
        return found


@functools.lru_cache(maxsize=4)
def load_vocabulary(path: str) -> Vocabulary:
    """Read a TSV or JSON vocabulary (see the module docstring); ValueError with file and line on bad input."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"--reward.concepts-vocab {path}: no such file (give a TSV 'term<TAB>id' or a JSON file)"
        )
    text = p.read_text(encoding="utf-8")
    pairs: list[tuple[str, str]] = []
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f'{path}: expected a JSON object {{"term": "id"}} or {{"id": ["term", ...]}}')
        for k, v in data.items():
            if isinstance(v, str):
                pairs.append((k, v))
            elif isinstance(v, list) and all(isinstance(t, str) for t in v):
                pairs.extend((t, k) for t in v)
            else:
                raise ValueError(f"{path}: entry {k!r} must map to an id string or a list of term strings")
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            cols = line.split("\t")
            if len(cols) < 2 or not cols[0].strip() or not cols[1].strip():
                raise ValueError(f"{path}:{lineno}: expected 'term<TAB>id', got {line[:80]!r}")
            if not pairs and cols[0].strip().lower() == "term" and cols[1].strip().lower() in ("id", "cui"):
                continue  # header
            pairs.append((cols[0].strip(), cols[1].strip()))
    vocab = Vocabulary(pairs)
    if not len(vocab):
        raise ValueError(f"{path}: the vocabulary has no terms")
    return vocab


def concept_f1(gen: set[str], ref: set[str]) -> float | None:
    """2 |gen ∩ ref| / (|gen| + |ref|); None when the reference has no concepts."""
    if not ref:
        return None
    return 2 * len(gen & ref) / (len(gen) + len(ref))


class _SciSpacy:
    """Concept Overlap's extractor: scispaCy entities linked to UMLS CUIs (top candidate of each entity).

    Needs, besides nanogrpo: `pip install scispacy` (PyPI), a scispaCy model such as en_core_sci_sm, which
    is not on PyPI (its release archive is listed in scispaCy's README), and the UMLS linker's knowledge
    base, about 1 GB that scispaCy downloads into ~/.scispacy (or $SCISPACY_CACHE) the first time the
    linker is built. docs/GRADERS.md has the steps.
    """

    def __init__(self, model: str):
        try:
            import scispacy.abbreviation  # noqa: F401  (registers the 'abbreviation_detector' pipe)
            import scispacy.linking  # noqa: F401  (registers the 'scispacy_linker' pipe)
            import spacy
        except ImportError:
            raise ValueError(
                "--reward.concepts-backend scispacy needs scispacy and a spaCy model: pip install scispacy, "
                "then the model's archive (e.g. en_core_sci_sm, listed in scispaCy's README; it is not on "
                "PyPI); or use the default 'vocab' backend"
            ) from None
        try:
            self.nlp = spacy.load(model)
        except OSError as e:  # spaCy's E050: no installed package or folder of that name
            raise ValueError(
                f"--reward.concepts-scispacy-model {model!r} does not load ({e}); install the model's archive "
                "listed in scispaCy's README (pip install <url of en_core_sci_sm-VERSION.tar.gz>) or give the "
                "folder of an unpacked spaCy model"
            ) from None
        # resolve_abbreviations reads the detector's long forms ('MI' after 'myocardial infarction (MI)');
        # without the detector in the pipeline it does nothing
        self.nlp.add_pipe("abbreviation_detector")
        try:
            self.nlp.add_pipe(
                "scispacy_linker", config={"resolve_abbreviations": True, "linker_name": "umls"}
            )
        except OSError as e:  # requests' errors are OSErrors: no network, or a server that refused
            raise ValueError(
                f"the scispaCy UMLS linker could not get its knowledge base ({e}): it downloads about 1 GB "
                "into ~/.scispacy (or $SCISPACY_CACHE) on first use, so run once where the network reaches "
                "scispaCy's release server, or use --reward.concepts-backend vocab with a UMLS vocabulary "
                "file (docs/GRADERS.md)"
            ) from None

    def batch(self, texts: list[str]) -> list[set[str]]:
        if not texts:  # every reference already cached: no pipeline call
            return []
        # spaCy refuses a text longer than nlp.max_length (1,000,000 characters by default): cut it there
        texts = [t[: self.nlp.max_length] for t in texts]
        # kb_ents: the linker's (CUI, score) candidates above its threshold, best first; [] when none passes
        return [{e._.kb_ents[0][0] for e in doc.ents if e._.kb_ents} for doc in self.nlp.pipe(texts)]


class Concepts(Grader):
    requires = ("reference",)

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        if cfg.concepts_backend == "scispacy":
            self.scispacy: _SciSpacy | None = _SciSpacy(cfg.concepts_scispacy_model)
            self.vocab = None
        elif cfg.concepts_backend == "vocab":
            self.scispacy = None
            if not cfg.concepts_vocab:
                warnings.warn(
                    "concepts: no --reward.concepts-vocab given; using nanogrpo's small DEMO vocabulary "
                    f"({DEMO_VOCAB.name}, about 90 terms, not UMLS). See docs/GRADERS.md to plug in UMLS or MeSH.",
                    stacklevel=2,
                )
            self.vocab = load_vocabulary(str(cfg.concepts_vocab or DEMO_VOCAB))
        else:
            raise ValueError(
                f"--reward.concepts-backend must be 'vocab' or 'scispacy', got {cfg.concepts_backend!r}"
            )
        self._ref_cache: dict[str, set[str]] = {}

    def check_row(self, row):
        return check_text_field(row, "reference")

    def _concepts(self, texts: list[str]) -> list[set[str]]:
        if self.scispacy is not None:
            return self.scispacy.batch(texts)
        return [self.vocab.concepts(t) for t in texts]

    def score(self, batch: list[Sample]) -> list[float | None]:
        refs = [s.row.get("reference") for s in batch]
        if len(self._ref_cache) > 100_000:  # bound the memory on huge datasets
            self._ref_cache.clear()
        todo = sorted({r for r in refs if isinstance(r, str) and r not in self._ref_cache})
        self._ref_cache.update(zip(todo, self._concepts(todo)))
        gens = self._concepts(
            [reply_text(s.completion, self.cfg.text_tag, self.cfg.think_tag) for s in batch]
        )
        return [concept_f1(g, self._ref_cache[r]) if isinstance(r, str) else None for g, r in zip(gens, refs)]


@register("concepts")
def _concepts(cfg: RewardConfig) -> Grader:
    return Concepts(cfg)
