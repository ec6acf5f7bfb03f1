"""Held-out evaluation: score completions, and compare two systems on the same rows.

eval.py is the command line over these functions; train.py calls `base_vs_trained` at the end of a run
(the same model with LoRA disabled is the base) and `save_eval` to keep the result in the run folder, and
--eval-every calls `answer_and_score` during training (nanogrpo/eval/during.py). The completions come from
nanogrpo/eval/generation.py; which run wrote a file, and the same-judge warning, from
nanogrpo/eval/provenance.py. Pairwise judging and Elo live in nanogrpo/eval/pairwise.py.

Scores per row (Concept Overlap): EM, token F1 and SeqM against the row's reference(s), plus any graders of
rewards/ by name (ROUGE-L by default). A metric that does not apply to a row (no reference, a grader's
None) is None and drops out of that metric's mean and of the paired comparison, never a 0. Concept Overlap
evaluates greedily; so does `generate_completions` by default.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from nanogrpo import judge_backend
from nanogrpo.eval import stats
from nanogrpo.eval.generation import generate_completions
from nanogrpo.eval.provenance import meta_path
from nanogrpo.formats import write_jsonl
from nanogrpo_base.rows import json_safe, prompt_text

judge_backend.register()  # local judges and probes built here (and by eval.py) run on nanogrpo.model.transformer

ANSWER_METRICS: dict[str, Callable[[str, list[str]], float]] = {
    "em": stats.exact_match,
    "f1": stats.token_f1,
    "seqm": stats.seq_match,
}

# ----------------------------------------------------------------------------- rows and prompts


def references(row: dict, target: str = "reference") -> list[str]:
    """The strings a completion is scored against: row[target], plus row['references'] for 'reference'."""
    refs = [] if row.get(target) is None else [str(row[target])]
    if target == "reference":
        refs += [str(r) for r in row.get("references") or []]
    return refs


def read_jsonl(path: str | Path, require: Sequence[str] = ("completion",)) -> list[dict]:
    """Rows of a JSONL file (nanogrpo_base's read_rows: blank lines skipped, bad lines refused with the file
    and the line); a row without a `require`d field is a ValueError naming it. Rows without an id get their
    line number."""
    from nanogrpo_base.rows import DataError, read_rows

    def check(row: dict, where: str) -> None:
        for name in require:
            if row.get(name) is None:
                raise DataError(f"{where}: missing field '{name}' (write {name} with eval.py generate)")

    return read_rows(path, check)


# ----------------------------------------------------------------------------- scoring


def score_rows(
    rows: Sequence[dict],
    completions: Sequence[str] | None = None,
    *,
    graders: str = "rouge_l",
    reward_cfg: Any = None,
    target: str = "reference",
    path: str = "data",
    reward_fn: Any = None,
    tokens: Sequence[int] | None = None,
    groups: Sequence[int] | None = None,
) -> list[dict[str, float | None]]:
    """Per row {metric: score or None}: em, f1, seqm against the row's references, then each grader.

    `completions` defaults to each row's 'completion'. `graders` is a comma list of rewards/ grader names
    ('' = none); None means the metric does not apply to that row (no reference, or the grader says so).
    `reward_fn` (a built rewards.RewardFunction) grades instead of `graders`: each of its graders, and
    'reward', the weighted reward it blends of them. `tokens` and `groups` are what its graders read as
    each completion's token count and its prompt's group (see `grade_batch`).
    """
    texts = [str(r.get("completion", "")) for r in rows] if completions is None else list(completions)
    assert len(texts) == len(rows), f"{len(texts)} completions for {len(rows)} rows"
    out: list[dict[str, float | None]] = []
    for row, text in zip(rows, texts):
        refs = references(row, target)
        out.append({m: (fn(text, refs) if refs else None) for m, fn in ANSWER_METRICS.items()})
    if reward_fn is not None:
        total, parts = grade_batch(reward_fn, rows, texts, path, tokens, groups)
        graded = {**parts, "reward": total}
    else:
        graded = grade(rows, texts, graders, reward_cfg, path)
    for name, vals in graded.items():
        for d, v in zip(out, vals):
            d[name] = v
    return out


def grade(
    rows: Sequence[dict], texts: Sequence[str], spec: str, reward_cfg: Any = None, path: str = "data"
) -> dict[str, list[float | None]]:
    """Scores of each named grader of rewards/ (one component each), e.g. spec 'rouge_l,numbers' (and, with
    reward_cfg.tasks, of every task's graders and each task's total). The rows are validated first: a field a grader needs and a row lacks is a ValueError naming `path`."""
    import rewards
    from rewards.spec import parse_spec

    names = [n for n, _ in parse_spec(spec)] if spec.strip() else []
    if not names:
        return {}
    from rewards.options import RewardConfig

    cfg = replace(reward_cfg or RewardConfig(), spec=",".join(f"{n}:1" for n in names))
    # with --reward.tasks a row is graded by its own task's mix: those graders' components come too, and
    # task/<name>, the total reward of that task's rows (None on other rows)
    return grade_batch(rewards.build_reward(cfg), rows, texts, path)[1]


def grade_batch(
    fn: Any,
    rows: Sequence[dict],
    texts: Sequence[str],
    path: str = "data",
    tokens: Sequence[int] | None = None,
    groups: Sequence[int] | None = None,
) -> tuple[list[float | None], dict[str, list[float | None]]]:
    """A built reward function's (rewards, {grader: scores}) of these completions, the rows validated first.

    `tokens`: each completion's token count (what the overlong grader reads; None: it does not apply).
    `groups`: each completion's prompt group (what group-wise options such as --reward.aggregate
    normalize-then-sum read); by default every row is a group of its own."""
    from rewards.base import Sample

    fn.validate(rows, path)
    batch = [
        Sample(
            prompt=prompt_text(r.get("prompt", "")),
            completion=t,
            group=i if groups is None else groups[i],
            row=r,
            tokens=None if tokens is None else tokens[i],
        )
        for i, (r, t) in enumerate(zip(rows, texts))
    ]
    total, components = fn(batch)
    return list(total), {n: list(v) for n, v in components.items()}


def summarise(scores: Sequence[dict[str, float | None]], n_resamples: int = 10_000, seed: int = 0) -> dict:
    """Per metric: n rows scored, mean and the 95% bootstrap interval of the mean."""
    out = {}
    for m in _metric_names(scores):
        vals = [s[m] for s in scores if s.get(m) is not None]
        if not vals:
            out[m] = {"n": 0, "mean": None, "low": None, "high": None}
            continue
        mean, lo, hi = stats.bootstrap_ci(vals, n_resamples, seed)
        out[m] = {"n": len(vals), "mean": mean, "low": lo, "high": hi}
    return out


def paired_summary(
    base_scores: Sequence[dict[str, float | None]],
    trained_scores: Sequence[dict[str, float | None]],
    seed: int = 0,
    n_resamples: int = 10_000,
) -> dict:
    """Per metric, over rows both systems have a score for: both means, the difference (trained - base)
    with its paired bootstrap 95% CI, and for EM McNemar's exact test. Row i of both lists is one item."""
    if len(base_scores) != len(trained_scores):
        raise ValueError(f"paired scores of different lengths: {len(base_scores)} vs {len(trained_scores)}")
    out = {}
    for m in _metric_names(base_scores):
        pairs = [(a[m], b.get(m)) for a, b in zip(base_scores, trained_scores)]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if not pairs:
            continue
        a, b = zip(*pairs)
        res = stats.paired_bootstrap(a, b, n_resamples, seed)
        if m == "em":
            res["mcnemar"] = stats.mcnemar_exact([x >= 0.5 for x in a], [x >= 0.5 for x in b])
        out[m] = res
    return out


# ----------------------------------------------------------------------------- distinct answers


def answer_of(text: str, reward_cfg: Any = None) -> str:
    """The answer a completion gives, read as the answer graders read it (exact, contains, reasoning_gym): the
    last <answer> block (--reward.answer-tag; --reward.answer-regex's match), else the completion without its
    <think> block; then SQuAD-normalised (stats.normalize_answer), so '1', ' 1.' and '<answer>1</answer>' agree."""
    from rewards.options import RewardConfig
    from rewards.text import extract, strip_think

    cfg = reward_cfg or RewardConfig()
    got = extract(str(text), cfg.answer_tag, cfg.answer_regex)
    return stats.normalize_answer(strip_think(str(text), cfg.think_tag) if got is None else got)


def answer_summary(texts: Sequence[str], reward_cfg: Any = None) -> dict:
    """stats.distinct_answers of these completions' answers (answer_of)."""
    return stats.distinct_answers([answer_of(t, reward_cfg) for t in texts])


CONSTANT_SHARE = 0.5
"""A system whose most common answer is at least this share of its answers (over 10 rows or more) is said to
give one answer: its gain may be that answer's share of the right ones, not the questions solved."""


def format_answers(answers: dict[str, dict]) -> str:
    """'answers: base 87 distinct of 100, the most common 4% ('paris'); trained 1 distinct of 100, ...', and a
    note for each system that gives one answer to CONSTANT_SHARE of the rows or more."""

    def one(name: str, a: dict) -> str:
        if not a["n"]:
            return f"{name} no answers"
        top = a["top"] if len(a["top"]) <= 30 else a["top"][:27] + "..."
        return f"{name} {a['distinct']} distinct of {a['n']}, the most common {a['top_share']:.0%} ({top!r})"

    lines = ["answers: " + "; ".join(one(name, a) for name, a in answers.items())]
    for name, a in answers.items():
        if a["n"] >= 10 and a["top_share"] >= CONSTANT_SHARE:
            lines.append(
                f"note: {name} gives the answer {a['top']!r} to {a['top_share']:.0%} of the rows: a score it gains "
                "may be that answer's share of the right ones, not questions solved"
            )
    return "\n".join(lines)


def _metric_names(scores: Sequence[dict]) -> list[str]:
    names: dict[str, None] = {}
    for s in scores:
        names.update(dict.fromkeys(s))
    return list(names)


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_summary_table(summary: dict) -> str:
    lines = [f"{'metric':<14}{'n':>6}{'mean':>9}  95% CI"]
    for m, s in summary.items():
        lines.append(f"{m:<14}{s['n']:>6}{_f(s['mean']):>9}  [{_f(s['low'])}, {_f(s['high'])}]")
    return "\n".join(lines)


def format_paired_table(summary: dict, names: tuple[str, str] = ("base", "trained")) -> str:
    """A short text table of `paired_summary`: '*' marks a CI that excludes 0."""
    a, b = (n[:10] for n in names)
    lines = [f"{'metric':<12}{'n':>5}{a:>11}{b:>11}{'diff':>9}  {'95% CI':<18}  McNemar p"]
    for m, s in summary.items():
        sig = "*" if s["low"] > 0 or s["high"] < 0 else " "
        ci = f"[{s['low']:+.3f}, {s['high']:+.3f}]{sig}"
        mc = s.get("mcnemar")
        p = f"{mc['p']:.3g} ({mc['only_a']}/{mc['only_b']})" if mc else ""
        lines.append(
            f"{m:<12}{s['n']:>5}{s['mean_a']:>11.3f}{s['mean_b']:>11.3f}{s['diff']:>+9.3f}  {ci:<18}  {p}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- several samples per prompt


def prompt_groups(rows: Sequence[dict]) -> list[list[int]]:
    """Row indices of each prompt, in first-seen order: rows that share an id are samples of one prompt
    (`eval.py generate --num-samples k` writes k rows per id, with `sample` 0..k-1)."""
    groups: dict[Any, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r.get("id", i), []).append(i)
    return list(groups.values())


def samples_summary(
    rows: Sequence[dict], scores: Sequence[dict[str, float | None]], n_resamples: int = 10_000, seed: int = 0
) -> dict | None:
    """Diversity and best-of-k over a file with several samples per prompt; None when each prompt has one.

    self_bleu: each prompt's Self-BLEU-4 over its samples (stats.self_bleu), averaged over prompts.
    best_of_k: per metric, each prompt's highest score over its samples (those with a score), averaged
    over prompts. Intervals are 95% bootstraps over prompts, since a prompt's samples are not independent.
    """
    groups = prompt_groups(rows)
    if all(len(g) == 1 for g in groups):
        return None
    sizes = sorted({len(g) for g in groups})

    def interval(vals: list[float]) -> dict:
        if not vals:
            return {"n": 0, "mean": None, "low": None, "high": None}
        mean, lo, hi = stats.bootstrap_ci(vals, n_resamples, seed)
        return {"n": len(vals), "mean": mean, "low": lo, "high": hi}

    texts = [str(r.get("completion", "")) for r in rows]
    sb = [v for g in groups if (v := stats.self_bleu([texts[i] for i in g])) is not None]
    best = {}
    for m in _metric_names(scores):
        per_prompt = [[scores[i][m] for i in g if scores[i].get(m) is not None] for g in groups]
        best[m] = interval([max(v) for v in per_prompt if v])
    return {
        "prompts": len(groups),
        "k": sizes[0] if len(sizes) == 1 else sizes,
        "self_bleu": {
            **interval(sb),
            "order": stats.BLEU_ORDER,
            "smoothing": "Lin-Och add-one for n>=2 (nltk method2)",
        },
        "best_of_k": best,
    }


def pass_and_mean(scores: Sequence[Sequence[float | None]], threshold: float) -> tuple[float, float] | None:
    """(pass@k, avg@k) over prompts, each with its k samples' scores: pass@k is the fraction of prompts with
    a sample scoring >= `threshold`, avg@k the mean over prompts of their samples' mean score. A sample
    without a score (None) passes nothing and is left out of the mean; a prompt with none is left out of
    both. None when no prompt has a score."""
    scored = [[x for x in s if x is not None] for s in scores]
    scored = [s for s in scored if s]
    if not scored:
        return None
    passed = sum(max(s) >= threshold for s in scored) / len(scored)
    return passed, sum(sum(s) / len(s) for s in scored) / len(scored)


def format_samples_table(s: dict) -> str:
    """best@k per metric and Self-BLEU, with 95% CIs over prompts."""
    k = s["k"] if isinstance(s["k"], int) else f"{s['k'][0]}-{s['k'][-1]}"
    lines = [
        f"{s['prompts']} prompts, k = {k} samples each",
        f"{'over prompts':<22}{'n':>6}{'mean':>9}  95% CI",
    ]
    rows = [(f"best@k {m}", v) for m, v in s["best_of_k"].items()] + [("self_bleu", s["self_bleu"])]
    for name, v in rows:
        lines.append(f"{name:<22}{v['n']:>6}{_f(v['mean']):>9}  [{_f(v['low'])}, {_f(v['high'])}]")
    lines.append(
        "(self_bleu: BLEU-4 of each sample against the prompt's other samples; higher = less diverse)"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- train.py's evaluations


def answer_and_score(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict],
    *,
    graders: str = "rouge_l",
    reward_cfg: Any = None,
    reward_fn: Any = None,
    seed: int = 0,
    num_samples: int = 1,
    episodes: list | None = None,
    **gen_kwargs: Any,
) -> tuple[list[str], list[dict[str, float | None]]]:
    """`num_samples` completions of each row by this model (greedy by default; gen_kwargs go to
    `generate_completions`) and their scores (`score_rows`), as flat lists: row i's at i*k .. i*k+k-1.
    With env=, `episodes` (a list) receives each episode's transcript, reward and info, in the same order.

    With `reward_fn` (the run's reward, built once) they are scored as training scores its samples: the
    graders read each completion's token count, a row's k completions are one group, and a 'reward' score
    comes with the graders'. Without it, by `graders` (names) under `reward_cfg`, each row on its own."""
    episodes = [] if episodes is None else episodes  # with env=: each episode's transcript, reward and info
    completions, lengths = generate_completions(
        model, tokenizer, rows, seed=seed, num_samples=num_samples, return_lengths=True, episodes=episodes,
        **gen_kwargs,
    )  # fmt: skip
    texts = [t for c in completions for t in c]
    flat = [r for r in rows for _ in range(num_samples)]
    if episodes:  # the env graders read these columns (rewards/episode.py)
        keep = ("turns", "env_reward", "env_info")
        flat = [{**r, **{k: e[k] for k in keep}} for r, e in zip(flat, episodes)]
    if reward_fn is None:
        return texts, score_rows(flat, texts, graders=graders, reward_cfg=reward_cfg)
    tokens = [n for ns in lengths for n in ns]
    groups = [i for i in range(len(rows)) for _ in range(num_samples)]
    return texts, score_rows(flat, texts, reward_fn=reward_fn, tokens=tokens, groups=groups)


def base_vs_trained(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict],
    *,
    graders: str = "rouge_l",
    reward_cfg: Any = None,
    seed: int = 0,
    **gen_kwargs: Any,
) -> dict:
    """Greedy (by default) completions of the base (LoRA disabled) and trained model on the same rows,
    scored and compared. Returns {"base": [...], "trained": [...], "base_scores", "trained_scores",
    "summary", "answers" (each side's distinct answers), "base_episodes", "trained_episodes" (with env=: each
    episode's transcript, reward and info; else [])}; gen_kwargs go to `generate_completions`."""
    from nanogrpo.model import lora

    score = dict(graders=graders, reward_cfg=reward_cfg, seed=seed)
    base_eps: list[dict] = []
    trained_eps: list[dict] = []
    with lora.disabled(model):
        base, bs = answer_and_score(model, tokenizer, rows, **score, episodes=base_eps, **gen_kwargs)
    trained, ts = answer_and_score(model, tokenizer, rows, **score, episodes=trained_eps, **gen_kwargs)
    return {
        "base": base,
        "trained": trained,
        "base_scores": bs,
        "trained_scores": ts,
        "summary": paired_summary(bs, ts, seed=seed),
        "answers": {"base": answer_summary(base, reward_cfg), "trained": answer_summary(trained, reward_cfg)},
        "base_episodes": base_eps,
        "trained_episodes": trained_eps,
    }


def save_eval(run_dir: str | Path, rows: Sequence[dict], result: dict) -> Path:
    """Write eval_base.jsonl, eval_trained.jsonl (each row with its completion and scores, and an episode's
    whole transcript: `turns`, `env_reward`, `env_info`, as eval.py generate writes them) and eval.json (the
    paired summary, which the run page shows, and each side's distinct answers), and each file's .meta.json
    saying which model wrote it (see provenance.py `run_of`)."""
    from nanogrpo.infra.metrics import replace_atomically  # run-folder files: never written through a link

    run_dir = Path(run_dir)
    for side, run in (("base", None), ("trained", ".")):
        meta = {"made_by": "train.py", "model": f"{side} (LoRA {'on' if run else 'off'})", "run": run}
        replace_atomically(meta_path(run_dir / f"eval_{side}.jsonl"), json.dumps(meta, indent=2) + "\n")
        recs = [
            {**r, "completion": c, "scores": s}
            for r, c, s in zip(rows, result[side], result[f"{side}_scores"])
        ]
        for rec, e in zip(recs, result.get(f"{side}_episodes") or ()):  # the whole episode, not its last turn
            rec.update({k: e[k] for k in ("turns", "env_reward", "env_info")})
        write_jsonl(run_dir / f"eval_{side}.jsonl", recs)
    path = run_dir / "eval.json"
    summary = {"n": len(rows), "metrics": result["summary"]}
    if "answers" in result:
        summary["answers"] = result["answers"]
    replace_atomically(path, json.dumps(json_safe(summary), indent=2, allow_nan=False))  # NaN: null
    return path
