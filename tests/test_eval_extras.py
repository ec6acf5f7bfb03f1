"""The seeds' evaluation extras: Self-BLEU and best@k (seed 003), Elo over judges and runs with verdicts
held to A/B/tie and accuracy against Elo (seed 000), the warning when a run is judged by its own training
grader (seed 001), and rubric verdicts on the run page (seed 004)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from nanogrpo.eval import evaluate, stats

ROOT = Path(__file__).resolve().parents[1]


def run_eval(*args, cwd):
    return subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- Self-BLEU and best@k


def test_self_bleu_identical_and_disjoint():
    assert stats.self_bleu(["the cat sat on the mat"] * 3) == pytest.approx(1.0)
    assert stats.self_bleu(["a b", "a b"]) == pytest.approx(1.0)  # shorter than 4 tokens: still 1
    assert stats.self_bleu(["red green blue", "one two three", "cat dog"]) == 0.0
    assert stats.self_bleu(["only one"]) is None


def test_self_bleu_worked_case():
    """'a b c d' and 'a b c': against each other, by hand.

    'a b c d' | 'a b c': p1 = 3/4, p2 = (2+1)/(3+1), p3 = (1+1)/(2+1), p4 = (0+1)/(1+1); c = 4 > r = 3,
    no brevity penalty. 'a b c' | 'a b c d': p1 = 3/3, p2 = 3/3, p3 = 2/2, p4 = (0+1)/(0+1) = 1; c = 3
    < r = 4, brevity exp(1 - 4/3).
    """
    long_ = (3 / 4 * 3 / 4 * 2 / 3 * 1 / 2) ** (1 / 4)
    short = math.exp(1 - 4 / 3)
    assert stats.sentence_bleu("a b c d".split(), ["a b c".split()]) == pytest.approx(long_)
    assert stats.sentence_bleu("a b c".split(), ["a b c d".split()]) == pytest.approx(short)
    assert stats.self_bleu(["A b c d", "a b, c"]) == pytest.approx(
        (
            stats.sentence_bleu("a b c d".split(), ["a b , c".split()])
            + stats.sentence_bleu("a b , c".split(), ["a b c d".split()])
        )
        / 2
    )  # lower case; punctuation is a token
    assert stats.self_bleu(["a b c d", "a b c"]) == pytest.approx((long_ + short) / 2)


def test_bleu_matches_nltk_method2():
    """Texts of 4+ tokens (nltk counts a missing n-gram order as 0/1, we as 0/0 -> 1), several references."""
    bleu = pytest.importorskip("nltk.translate.bleu_score")
    texts = [
        "the cat sat on the mat today",
        "a cat sat on a mat",
        "the dog sat on the log near the mat",
        "on the mat the cat sat quietly today",
        "completely different words here now",
    ]
    tok = [stats.bleu_tokens(t) for t in texts]
    smooth = bleu.SmoothingFunction().method2
    for i, h in enumerate(tok):
        refs = tok[:i] + tok[i + 1 :]
        want = bleu.sentence_bleu(refs, h, smoothing_function=smooth)
        assert stats.sentence_bleu(h, refs) == pytest.approx(want, abs=1e-12)


def test_best_of_k_and_self_bleu_in_score(tmp_path):
    """Two prompts with three samples each (as generate --num-samples 3 writes them)."""
    comps = {"p": ["Paris", "Lyon", "paris!"], "q": ["five", "four", "three"]}
    refs = {"p": "Paris", "q": "four"}
    rows = [
        {"id": i, "prompt": f"question {i}", "reference": refs[i], "completion": c, "sample": k}
        for i, cs in comps.items()
        for k, c in enumerate(cs)
    ]
    f = write_rows(tmp_path / "gen.jsonl", rows)
    res = run_eval("score", f, "--json", tmp_path / "s.json", "--resamples", 200, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    sm = s["samples"]
    assert sm["prompts"] == 2 and sm["k"] == 3
    assert s["metrics"]["em"]["mean"] == pytest.approx(3 / 6)  # Paris, paris!, four
    assert sm["best_of_k"]["em"]["mean"] == 1.0 and sm["best_of_k"]["em"]["n"] == 2
    best_seqm = [max(stats.seq_match(c, refs[i]) for c in cs) for i, cs in comps.items()]
    assert sm["best_of_k"]["seqm"]["mean"] == pytest.approx(sum(best_seqm) / 2)
    assert sm["self_bleu"]["mean"] == pytest.approx(
        (stats.self_bleu(comps["p"]) + stats.self_bleu(comps["q"])) / 2
    )
    assert sm["self_bleu"]["order"] == 4
    assert "best@k em" in res.stdout and "self_bleu" in res.stdout


def test_one_sample_per_prompt_has_no_samples_summary():
    rows = [{"id": i, "reference": "x", "completion": "x"} for i in range(3)]
    assert evaluate.samples_summary(rows, evaluate.score_rows(rows, graders=""), 100) is None
