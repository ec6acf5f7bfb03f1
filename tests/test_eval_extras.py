"""The seeds' evaluation extras: Self-BLEU and best@k (RLVRR), Elo over judges and runs with verdicts
held to A/B/tie and accuracy against Elo (Shaping Explanations), the warning when a run is judged by its own training
grader (the graders guide), and rubric verdicts on the run page (Small-LM Judges)."""

import json
import math
from pathlib import Path

import pytest
from helpers import run_eval, write_rows

from nanogrpo.eval import evaluate, provenance, stats

ROOT = Path(__file__).resolve().parents[1]


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


# ----------------------------------------------------------------------------- Elo over judges and runs

from nanogrpo.eval import elo_plots, pairwise  # noqa: E402


@pytest.mark.parametrize(
    "reply, verdict",
    [("Verdict: A", "A"), ("**Verdict:** tie.", "tie"), ("Verdict: **B**", "B"), ("Verdict: A/B", None),
     ("Verdict: A or B", None), ("Verdict: Answer A", None), ("I prefer A", None), ("", None)],
)  # fmt: skip
def test_verdict_is_a_b_or_tie_and_nothing_else(reply, verdict):
    assert pairwise.parse_verdict(reply) == verdict


def test_a_verdict_outside_a_b_tie_is_counted_not_guessed():
    """A judge answering 'both' or 'a' (lower case is still A): 'both' is dropped and reported per judge."""
    systems = {
        n: [{"id": i, "prompt": "q", "reference": "r", "completion": n} for i in range(4)] for n in "xy"
    }
    answers = iter(["a", "both", "B", "tie"] * 2)  # 4 ids x both orders
    recs = pairwise.run_pairwise(systems, {"odd": lambda p, r, a, b: next(answers)}, progress=False)
    assert [r["verdict"] for r in recs[:4]] == ["A", None, "B", "tie"]
    assert recs[1]["raw_verdict"] == "both"
    rep = pairwise.elo_report(recs, ["x", "y"], n_resamples=20)
    assert rep["invalid"] == 2 and rep["games"] == 6
    assert rep["invalid_verdicts"]["odd"] == {"count": 2, "asked": 8, "values": {"both": 2}}
    table = pairwise.format_elo_table(rep)
    assert "odd: 2 of 8 verdicts not A/B/tie, dropped (not guessed): 'both' x2" in table


def _verdicts(judge, better, worse, ids, flip_every=0):
    """Records where `better` wins both orders on every id (but every flip_every-th id goes to `worse`)."""
    out = []
    for i in ids:
        win = worse if flip_every and i % flip_every == 0 else better
        for first, second in ((better, worse), (worse, better)):
            out.append({"id": i, "judge": judge, "first": first, "second": second,
                        "verdict": "A" if first == win else "B"})  # fmt: skip
    return out


def test_variant_elo_is_mean_over_judges_and_runs_with_min_max(tmp_path):
    """Two judges' verdict files on runs grpo#1, grpo#2 against base: the variant's Elo is the mean of its
    four per-judge run ratings, the bars their min and max; the same judge in two files is two judges."""
    ids = range(20)
    recs1 = _verdicts("j", "grpo#1", "base", ids, 4) + _verdicts("j", "grpo#2", "base", ids, 3)
    recs2 = _verdicts("j", "grpo#1", "base", ids, 3) + _verdicts("j", "grpo#2", "base", ids, 5)
    recs2 += [{"id": 99, "judge": "j", "first": "base", "second": "grpo#1", "verdict": "Answer B"}]
    f1, f2 = write_rows(tmp_path / "v1.jsonl", recs1), write_rows(tmp_path / "v2.jsonl", recs2)
    res = run_eval("elo", "--verdicts", f1, f2, "--out", tmp_path / "elo", "--resamples", 50, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp_path / "elo.json").read_text())
    assert set(rep["judges"]) == {"j#1", "j#2"}
    ratings = [rep["judges"][j][s]["elo"] for j in ("j#1", "j#2") for s in ("grpo#1", "grpo#2")]
    v = rep["variants"]["grpo"]
    assert v["runs"] == ["grpo#1", "grpo#2"] and v["ratings"] == 4
    assert v["mean"] == pytest.approx(sum(ratings) / 4)
    assert (v["min"], v["max"]) == (pytest.approx(min(ratings)), pytest.approx(max(ratings)))
    assert rep["variants"]["base"]["max"] < v["min"]
    assert rep["invalid_verdicts"]["j#2"]["values"] == {"Answer B": 1}
    assert "(mean over judges and runs)" in res.stdout and "'Answer B' x1" in res.stdout
    assert (tmp_path / "elo.png").read_bytes()[:4] == b"\x89PNG"
    names, mid, lo, hi, what = elo_plots._bars(rep)
    assert names == ["base", "grpo"] and what == "min-max over 2 judges x 2 runs"
    assert (mid[1], lo[1], hi[1]) == (v["mean"], v["min"], v["max"])
    # refitting into the file it reads from would destroy it
    res = run_eval(
        "elo", "--verdicts", tmp_path / "elo_comparisons.jsonl", "--out", tmp_path / "elo", cwd=tmp_path
    )
    assert res.returncode != 0 and "pass another --out" in res.stderr


def test_repeated_names_are_runs_not_judged_against_each_other(tmp_path):
    rows = lambda text: [
        {"id": i, "prompt": "q", "reference": "the answer", "completion": text} for i in range(5)
    ]
    files = [
        write_rows(tmp_path / f"{k}.jsonl", rows(t))
        for k, t in enumerate(["the answer", "the answer is", "no"])
    ]
    res = run_eval("elo", *files, "--names", "grpo", "grpo", "base", "--judges", "f1", "--out", tmp_path / "e",
                   "--resamples", 20, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp_path / "e.json").read_text())
    assert rep["systems"] == ["grpo#1", "grpo#2", "base"]
    recs = [json.loads(x) for x in (tmp_path / "e_comparisons.jsonl").read_text().splitlines()]
    assert len(recs) == 5 * 2 * 2 and all("base" in (r["first"], r["second"]) for r in recs)
    assert rep["variants"]["grpo"]["runs"] == ["grpo#1", "grpo#2"]


def test_accuracy_against_elo(tmp_path):
    """Accuracy from score summaries (two runs of grpo) and Elo from the fit: one point per variant."""
    ids = range(20)
    recs = _verdicts("j", "grpo#1", "base", ids, 4) + _verdicts("j", "grpo#2", "base", ids, 2)
    v = write_rows(tmp_path / "v.jsonl", recs)
    for name, em in (("g1", 0.6), ("g2", 0.5), ("b", 0.4)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"metrics": {"em": {"mean": em}}}))
    scored = write_rows(
        tmp_path / "b.scored.jsonl", [{"id": 0, "completion": "c", "scores": {"em": x}} for x in (0, 1)]
    )
    res = run_eval("elo", "--verdicts", v, "--out", tmp_path / "elo", "--resamples", 20, "--accuracy",
                   f"grpo={tmp_path / 'g1.json'}", f"grpo#2={tmp_path / 'g2.json'}", f"base={scored}",
                   "--accuracy-baseline", "base", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp_path / "elo.json").read_text())
    acc = rep["accuracy"]["variants"]
    assert acc["grpo"]["accuracy"] == pytest.approx(0.55) and (
        acc["grpo"]["acc_min"],
        acc["grpo"]["acc_max"],
    ) == (0.5, 0.6)
    assert acc["grpo"]["runs"] == 2 and acc["base"]["accuracy"] == 0.5
    assert acc["grpo"]["elo"] == rep["variants"]["grpo"]["mean"]
    assert (tmp_path / "elo_accuracy.png").read_bytes()[:4] == b"\x89PNG"
    bad = run_eval(
        "elo",
        "--verdicts",
        v,
        "--out",
        tmp_path / "e2",
        "--accuracy",
        f"sft={tmp_path / 'g1.json'}",
        cwd=tmp_path,
    )
    assert bad.returncode != 0 and "not a system or variant" in bad.stderr
    bad = run_eval(
        "elo", "--verdicts", v, "--out", tmp_path / "e3", "--accuracy-baseline", "sft", cwd=tmp_path
    )
    assert bad.returncode != 0 and "--accuracy-baseline 'sft' is not a variant" in bad.stderr


def test_accuracy_from_scored_files(tmp_path):
    rows = lambda text, em: [{"id": i, "prompt": "q", "reference": "a", "completion": text, "scores": {"em": em}}
                             for i in range(4)]  # fmt: skip
    a = write_rows(tmp_path / "a.scored.jsonl", rows("a", 1.0))
    b = write_rows(tmp_path / "b.scored.jsonl", rows("x", 0.0))
    res = run_eval("elo", a, b, "--judges", "f1", "--out", tmp_path / "e", "--resamples", 20, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    acc = json.loads((tmp_path / "e.json").read_text())["accuracy"]
    assert acc["metric"] == "em" and acc["variants"]["a.scored"]["accuracy"] == 1.0
    assert (tmp_path / "e_accuracy.png").exists()


# ----------------------------------------------------------------------------- judged by its own grader


def _run_folder(path, spec="rouge_l:1", judge_model="", readout="generative"):
    path.mkdir(parents=True, exist_ok=True)
    reward = {"spec": spec, "judge": {"model": judge_model}, "rubric": {"readout": readout, "probe": ""}}
    (path / "config.json").write_text(json.dumps({"algo": "grpo", "reward": reward}))
    (path / "adapter").mkdir(exist_ok=True)
    return path


ROWS = [
    {"id": i, "prompt": "q", "reference": "the cat sat", "completion": c}
    for i, c in enumerate(["the cat", "a dog"])
]


def test_score_warns_when_the_training_grader_judges(tmp_path):
    run = _run_folder(tmp_path / "run")
    f = write_rows(run / "trained.jsonl", ROWS)
    res = run_eval("score", f, "--resamples", 50, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    warn = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "grader rouge_l, which also trained it" in warn[0]
    assert "inflated" in warn[0] and "not trained on" in warn[0] and str(run / "config.json") in warn[0]
    res = run_eval("score", f, "--graders", "", "--resamples", 50, cwd=tmp_path)  # EM/F1/SeqM only
    assert res.returncode == 0 and "warning:" not in res.stderr


def test_the_run_is_found_through_generate_meta(tmp_path):
    """Completions written elsewhere name their adapter's run in FILE.meta.json; the base model's none."""
    run = _run_folder(tmp_path / "runs" / "a", spec="judge:1", judge_model="Qwen/Qwen2.5-7B-Instruct")
    (run / "ckpt" / "step_000080").mkdir(parents=True)
    out = tmp_path / "evals" / "trained.jsonl"
    for adapter in (run / "adapter", run / "ckpt" / "step_000080"):
        provenance.write_meta(out, model="smollm2", adapter=str(adapter))
        assert provenance.run_of(out) == run.resolve()
        assert provenance.run_of(tmp_path / "evals" / "trained.scored.jsonl") == run.resolve()
    # the judge model served under another name
    msg = provenance.same_judge_warning(out, judge_models=["qwen2.5-7b-instruct"])
    assert msg and "judge model Qwen/Qwen2.5-7B-Instruct" in msg
    assert provenance.same_judge_warning(out, graders=["rouge_l"], judge_models=["other-judge"]) is None
    base = run / "base.jsonl"  # in the run folder, but written by the base model
    provenance.write_meta(base, model="smollm2", adapter="")
    assert (
        provenance.run_of(base) is None
        and provenance.same_judge_warning(base, ["judge"], ["Qwen2.5-7B-Instruct"]) is None
    )


def test_rubric_with_the_training_judge_model_warns():
    """Trained with the judge grader, evaluated with rubric on the same model: same blind spots."""
    from rewards.options import JudgeConfig, RewardConfig

    cfg = RewardConfig(judge=JudgeConfig(model="org/judge-8b"))
    assert provenance.eval_judges(["rubric"], cfg) == ["org/judge-8b"]
    assert provenance.eval_judges(["rouge_l"], cfg) == []
    graders, models = provenance.trained_with(
        {"spec": "judge+similarity:1,rouge_l:0", "judge": {"model": "org/judge-8b"}}
    )
    assert graders == {"judge+similarity"} and models == {
        "judge-8b": "org/judge-8b"
    }  # weight 0 is not trained on


def test_compare_and_elo_warn_once_per_run(tmp_path):
    run = _run_folder(tmp_path / "run")
    base = write_rows(tmp_path / "base.jsonl", [{**r, "completion": "no"} for r in ROWS])
    trained = write_rows(run / "trained.jsonl", ROWS)
    res = run_eval("compare", base, trained, "--resamples", 50, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("warning:") == 1 and f"{trained} is judged by grader rouge_l" in res.stderr
    res = run_eval("elo", base, trained, "--judges", "grader:rouge_l", "f1", "--out", tmp_path / "e",
                   "--resamples", 20, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("warning:") == 1 and "grader rouge_l" in res.stderr
    res = run_eval(
        "elo", base, trained, "--judges", "f1", "--out", tmp_path / "e", "--resamples", 20, cwd=tmp_path
    )
    assert res.returncode == 0 and "warning:" not in res.stderr


def test_train_eval_files_say_which_model_wrote_them(tmp_path):
    run = _run_folder(tmp_path / "run")
    res = {"base": ["x"], "trained": ["y"], "base_scores": [{}], "trained_scores": [{}], "summary": {}}
    evaluate.save_eval(run, [{"id": 0, "prompt": "q"}], res)
    assert provenance.run_of(run / "eval_base.jsonl") is None
    assert provenance.run_of(run / "eval_trained.jsonl") == run.resolve()


@pytest.mark.slow
def test_generate_records_the_adapters_run(tmp_path):
    import torch

    from nanogrpo.model import lora
    from nanogrpo.model.transformer import Transformer
    from nanogrpo.model.zoo import resolve_model

    run = _run_folder(tmp_path / "run")
    model = Transformer.from_pretrained(resolve_model("tiny"), dtype=torch.float32, device="cpu")
    lora.inject_lora(model, r=2, alpha=4.0, targets=("q_proj",))
    lora.save_adapter(model, run / "adapter")
    data = write_rows(tmp_path / "held.jsonl", [{"id": "a", "prompt": "Hi?", "reference": "the cat sat"}])
    out = tmp_path / "gen" / "trained.jsonl"
    args = ["generate", "--model", "tiny", "--adapter", run / "adapter", "--data", data, "--out", out,
            "--max-new-tokens", 3, "--dtype", "float32", "--device", "cpu", "--num-samples", 2, "--temperature", 1]  # fmt: skip
    res = run_eval(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "gen" / "trained.meta.json").read_text())
    assert meta["run"] == "../run" and meta["num_samples"] == 2 and meta["adapter"] == str(run / "adapter")
    res = run_eval("score", out, "--resamples", 20, cwd=tmp_path)
    assert res.returncode == 0 and "best@k rouge_l" in res.stdout
    assert "warning: " + str(out) + " is judged by grader rouge_l" in res.stderr


def test_run_page_says_when_its_eval_used_the_training_graders(tmp_path):
    run = _run_folder(tmp_path / "run")
    s = evaluate.paired_summary(
        [{"em": 0.0, "rouge_l": 0.1}] * 4, [{"em": 1.0, "rouge_l": 0.9}] * 4, n_resamples=50
    )
    (run / "eval.json").write_text(json.dumps({"n": 4, "metrics": s}))
    from nanogrpo.eval import report

    page = report.write_report(run).read_text()
    assert "Scored with the graders the run trained on (rouge_l)" in page
    (run / "config.json").write_text(json.dumps({"reward": {"spec": "exact:1"}}))
    assert "Scored with the graders" not in report.write_report(run).read_text()


# ----------------------------------------------------------------------------- rubric verdicts on the run page

from nanogrpo.eval import report, report_rubric  # noqa: E402

RUBRIC = [("Names the drug class", 2.0), ("Gives the dose", 1.0), ("Invents a citation", -1.0)]


def _rubric_run(root, verdicts_per_step):
    """A run folder whose samples.jsonl carries rubric details as train.py logs them (one group of two
    completions per step; verdicts_per_step[step] = [[v per criterion] per completion])."""
    run = root / "rubric-run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"reward": {"spec": "rubric:1"}}))
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "reward": 0.5, "reward/rubric": 0.5}) + "\n" for s in verdicts_per_step
        )
    )
    lines = []
    for step, per_comp in verdicts_per_step.items():
        comps = []
        for k, vs in enumerate(per_comp):
            crit = [{"criterion": c, "weight": w, "verdict": v} for (c, w), v in zip(RUBRIC, vs)]
            comps.append({"text": f"answer {k}", "reward": 0.5, "scores": {"rubric": 0.5}, "advantage": 0.0,
                          "length": 3, "rubric": {"criteria": crit, "score": 0.5}})  # fmt: skip
        lines.append(
            json.dumps(
                {"step": step, "groups": [{"id": "q1", "prompt": "Which drug?", "completions": comps}]}
            )
        )
    (run / "samples.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_rubric_pass_rates_over_steps(tmp_path):
    run = _rubric_run(tmp_path, {1: [[0, 0, 1], [1, None, 1]], 5: [[1, 1, 0], [1, 0, 0]]})
    steps, rates = report_rubric.rubric_rates(report.read_jsonl(run / "samples.jsonl"))
    assert steps == [1.0, 5.0]
    assert rates["Names the drug class"]["rates"] == [0.5, 1.0] and rates["Names the drug class"]["n"] == 4
    assert (
        rates["Gives the dose"]["rates"] == [0.0, 0.5] and rates["Gives the dose"]["n"] == 3
    )  # None is no verdict
    assert (
        rates["Invents a citation"]["rates"] == [1.0, 0.0] and rates["Invents a citation"]["weight"] == -1.0
    )
    assert rates["criteria met"]["rates"] == [pytest.approx(1 / 3), pytest.approx(3 / 4)]
    assert rates["pitfalls committed"]["rates"] == [1.0, 0.0]


def test_rubric_section_on_the_run_page(tmp_path):
    run = _rubric_run(tmp_path, {1: [[0, 0, 1], [1, None, 1]], 5: [[1, 1, 0], [1, 0, 0]]})
    page = report.write_report(run).read_text()
    assert "<section id='rubric'>" in page and "Latest verdicts (step 5)" in page
    assert page.count("class='criterion'") == 3  # the latest step's one group: a row per criterion
    rubric = page[page.index("<section id='rubric'>") : page.index("<section id='samples'>")]
    assert 'data-title="rubric: share met per criterion"' in rubric
    assert rubric.count('<span class="key">') == 2 + 3  # met and pitfalls, then each criterion
    assert (run / "rubric_met.png").exists() and (run / "rubric_criteria.png").exists()
    # the latest table: 'Invents a citation' not committed is good news (green), a missed dose bad (red)
    latest = rubric[rubric.index("Latest verdicts") :]
    row = latest[latest.index("Invents a citation</td>") :].split("</tr>")[0]
    assert row.count('class="met">no<') == 2
    row = latest[latest.index("Gives the dose</td>") :].split("</tr>")[0]
    assert '<td class="met">yes</td><td class="unmet">no</td>' in row
    samples = page[page.index("<section id='samples'>") :]
    assert "<th>rubric verdicts</th>" in samples and 'class="pitfall">yes: Invents a citation' in samples


def test_no_rubric_section_without_rubric_details(tmp_path):
    run = tmp_path / "plain"
    run.mkdir()
    (run / "samples.jsonl").write_text(
        json.dumps({"step": 1, "groups": [{"id": 1, "completions": [{"text": "x"}]}]}) + "\n"
    )
    page = report.write_report(run).read_text()
    assert "id='rubric'" not in page and "rubric verdicts" not in page
