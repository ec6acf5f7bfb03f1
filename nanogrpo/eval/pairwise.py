"""Pairwise judging of two or more systems' answers, and Elo ratings from the preferences (Shaping Explanations).

A judge is any callable `prefer(prompt, reference, answer_a, answer_b) -> 'A' | 'B' | 'tie'`. It sees no
system names (the answers are anonymous), and every pair is asked in both orders, so a judge that
favours the first position gives each system the same number of first positions and the bias cancels.
Each answer of a pair is one game; ratings are a Bradley-Terry fit on the Elo scale (nanogrpo.eval.stats)
with item-bootstrap intervals, per judge and pooled over judges.

Shaping Explanations reports each variant's mean Elo over three judges and three runs, with min-max bars;
elo_plots.py draws that. A system named 'VARIANT#RUN' is one run of VARIANT (eval.py elo --names grpo
grpo base names them grpo#1, grpo#2, base): runs of one variant are not judged against each other, and
the variant's rating is the mean of its runs' ratings over every judge, its bars the min and max of
those. Its Fig. 3, accuracy against Elo, is elo_plots.plot_accuracy_vs_elo.

Verdicts are 'A', 'B' or 'tie' and nothing else: a reply without a clean 'Verdict: ...' last line, or a
judge's or a verdict file's value outside those three, is dropped and counted per judge, never guessed.
Judges: `LLMJudge` (an OpenAI-compatible chat-completions server or a local model, through
rewards.llm_client) and `MetricJudge` (higher EM / F1 / SeqM / grader score wins; deterministic, for
tests and judge-free checks).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from nanogrpo.eval import stats
from nanogrpo.eval.evaluate import ANSWER_METRICS, grade, references
from nanogrpo_base.rows import prompt_text

Judge = Callable[[str, "str | None", str, str], str]

PAIRWISE_PROMPT = """You compare two answers to the same question.

Question:
{prompt}

Reference answer (written by an expert):
{reference}

Answer A:
{a}

Answer B:
{b}

Which answer is better? Judge logical soundness, clarity, completeness and focus, and agreement with the
reference. Length is not a merit. Call a tie only when neither is clearly better.
Reply with one or two sentences of reasoning, then a last line that is exactly one of:
Verdict: A
Verdict: B
Verdict: tie"""

PAIRWISE_MAX_TOKENS = 256
"""Reply budget of a pairwise judgement (a sentence or two and the verdict line) when
--server.max-tokens is 0: servers refuse max_tokens 0."""

# 'Verdict: A' ending its line (markdown and a full stop allowed around it): 'Verdict: A/B', 'Verdict: A or
# B' or 'Verdict: Answer A' are no verdict, since reading one into them would be a guess.
_VERDICT = re.compile(r"verdict\W*(a|b|tie)[\s*_.!\"'`)\]]*$", re.IGNORECASE | re.MULTILINE)
VERDICTS = ("A", "B", "tie")


def parse_verdict(reply: str) -> str | None:
    """'A', 'B' or 'tie' from the judge's last 'Verdict: ...' line; None when there is none."""
    found = _VERDICT.findall(reply or "")
    return normalize_verdict(found[-1]) if found else None


def normalize_verdict(value: Any) -> str | None:
    """'A', 'B' or 'tie' (any case, surrounding spaces ignored); None for anything else."""
    v = value.strip().lower() if isinstance(value, str) else None
    return {"a": "A", "b": "B", "tie": "tie"}.get(v or "")


def variant_of(system: str) -> str:
    """'grpo#2' -> 'grpo': the variant a run belongs to; a name without '#RUN' is its own variant."""
    head, sep, run = system.rpartition("#")
    return head if sep and head and run else system


class MetricJudge:
    """Prefers the answer with the higher metric score: 'em', 'f1', 'seqm' or a rewards/ grader name."""

    def __init__(self, metric: str, tol: float = 1e-9, reward_cfg: Any = None):
        self.metric, self.tol, self.reward_cfg = metric, tol, reward_cfg

    def _score(self, prompt: str, reference: str | None, text: str) -> float:
        if self.metric in ANSWER_METRICS:
            return ANSWER_METRICS[self.metric](text, [reference or ""])
        row = {"prompt": prompt, "reference": reference}
        s = grade([row], [text], self.metric, self.reward_cfg)[self.metric][0]
        return -1.0 if s is None else s

    def __call__(self, prompt: str, reference: str | None, answer_a: str, answer_b: str) -> str:
        sa, sb = self._score(prompt, reference, answer_a), self._score(prompt, reference, answer_b)
        return "tie" if abs(sa - sb) <= self.tol else ("A" if sa > sb else "B")


class LLMJudge:
    """An LLM judge through rewards.llm_client: an OpenAI-compatible server, or a local model folder.

    `ask_many` sends every question at once (the client bounds the requests in flight and retries);
    a failed call or a reply without a verdict gives None, which the Elo fit drops and counts.
    """

    def __init__(self, cfg: Any):
        from rewards.llm_client import make_client

        self.cfg, self.client = cfg, make_client(cfg)

    def ask_many(self, questions: Sequence[tuple[str, str | None, str, str]]) -> list[tuple[str | None, str]]:
        from rewards.llm_client import ChatRequest

        cut = self.cfg.max_answer_chars
        reqs = [
            ChatRequest(
                [
                    {
                        "role": "user",
                        "content": PAIRWISE_PROMPT.format(
                            prompt=p, reference=(r or "(none)")[:cut], a=a[:cut], b=b[:cut]
                        ),
                    }
                ],
                max_tokens=self.cfg.max_tokens or PAIRWISE_MAX_TOKENS,
            )
            for p, r, a, b in questions
        ]
        replies = self.client.chat(reqs)
        return [(parse_verdict(rep.text or ""), (rep.text or rep.error or "").strip()) for rep in replies]

    def __call__(self, prompt: str, reference: str | None, answer_a: str, answer_b: str) -> str | None:
        return self.ask_many([(prompt, reference, answer_a, answer_b)])[0][0]  # None: no verdict, not a tie


def make_judge(spec: str, server: Any = None, reward_cfg: Any = None) -> Judge:
    """'em' | 'f1' | 'seqm' | 'grader:NAME' (deterministic), 'openai:MODEL' (an LLM behind
    server.base_url) or 'local:PATH' (a model folder); `server` is a rewards JudgeConfig."""
    from dataclasses import replace

    from rewards.options import JudgeConfig

    if spec in ANSWER_METRICS:
        return MetricJudge(spec)
    kind, _, arg = spec.partition(":")
    if kind == "grader" and arg:
        return MetricJudge(arg, reward_cfg=reward_cfg)
    if kind in ("openai", "local") and arg:
        return LLMJudge(replace(server or JudgeConfig(), backend=kind, model=arg, json_mode="off"))
    raise ValueError(
        f"unknown judge {spec!r}: use em, f1, seqm, grader:NAME (e.g. grader:rouge_l), openai:MODEL or local:PATH"
    )


def check_judges(specs: Sequence[str], server: Any = None, reward_cfg: Any = None) -> None:
    """Before any model loads: every 'openai:MODEL' judge's server answers, and so does the judge
    server of a 'grader:NAME' that calls one; ValueError naming the URL and the flag to fix."""
    from dataclasses import replace

    from rewards import build_reward
    from rewards.llm_client import check_endpoint
    from rewards.options import JudgeConfig, RewardConfig

    for spec in specs:
        kind, _, arg = spec.partition(":")
        if kind == "openai" and arg:
            check_endpoint(replace(server or JudgeConfig(), backend="openai", model=arg), "--server")
        elif kind == "grader" and arg:
            build_reward(replace(reward_cfg or RewardConfig(), spec=f"{arg}:1")).check()


# ----------------------------------------------------------------------------- the tournament


def align(systems: dict[str, Sequence[dict]]) -> list[Any]:
    """Ids present in every system's rows, in the first system's order."""
    ids = [r["id"] for r in next(iter(systems.values()))]
    common = set(ids).intersection(*({r["id"] for r in rows} for rows in systems.values()))
    return [i for i in ids if i in common]


def run_pairwise(
    systems: dict[str, Sequence[dict]], judges: dict[str, Judge], progress: bool = True
) -> list[dict]:
    """Ask every judge about every pair of systems on every shared id, in both orders; runs of one
    variant ('grpo#1', 'grpo#2') are not asked about each other.

    Returns one record per question: id, judge, first, second (system names in the order shown),
    verdict ('A' | 'B' | 'tie' | None when there was none) and, for LLM judges, the reply; a callable's
    answer outside A/B/tie is kept as raw_verdict.
    """
    from tqdm import tqdm

    if len(systems) < 2:
        raise ValueError("pairwise judging needs at least two systems")
    by_id = {name: {r["id"]: r for r in rows} for name, rows in systems.items()}
    pairs = []  # (id, first, second): both orders of every pair
    matches = [(x, y) for x, y in combinations(systems, 2) if variant_of(x) != variant_of(y)]
    if not matches:
        raise ValueError(f"{list(systems)} are all runs of one variant: give two or more variants")
    for i in align(systems):
        for x, y in matches:
            pairs += [(i, x, y), (i, y, x)]
    questions = []
    for i, first, second in pairs:
        row = by_id[first][i]
        refs = references(row)
        questions.append(
            (
                prompt_text(row.get("prompt", "")),
                refs[0] if refs else None,
                str(row.get("completion", "")),
                str(by_id[second][i].get("completion", "")),
            )
        )
    records = []
    for jname, judge in judges.items():
        if hasattr(judge, "ask_many"):
            answers = judge.ask_many(questions)
        else:
            answers = [(judge(*q), None) for q in tqdm(questions, desc=jname, disable=not progress)]
        for (i, first, second), (raw, reply) in zip(pairs, answers):
            verdict = normalize_verdict(raw)
            rec = {"id": i, "judge": jname, "first": first, "second": second, "verdict": verdict}
            if verdict is None and raw is not None:  # e.g. 'both', 'A/B': counted as invalid, not guessed
                rec["raw_verdict"] = str(raw)
            records.append(rec if reply is None else {**rec, "reply": reply})
    return records


def load_verdicts(paths: Sequence[str | Path]) -> list[dict]:
    """The records of earlier `eval.py elo` runs (their OUT_comparisons.jsonl), to fit them together.

    Each record needs id, judge, first and second; a verdict outside A/B/tie becomes None with the value
    kept as raw_verdict. A judge found in more than one file is one judge per file, 'JUDGE#N' for the
    N-th file, so repeated judging runs give their own ratings and widen the min-max bars.
    """
    from nanogrpo_base.rows import DataError, read_rows

    def check(row: dict, where: str) -> None:
        for name in ("id", "judge", "first", "second"):
            if row.get(name) is None:
                raise DataError(
                    f"{where}: missing field '{name}' (pass the OUT_comparisons.jsonl of eval.py elo)"
                )

    per_file = [read_rows(p, check) for p in paths]
    seen: dict[str, set[int]] = {}
    for n, rows in enumerate(per_file):
        for r in rows:
            seen.setdefault(r["judge"], set()).add(n)
    out = []
    for n, rows in enumerate(per_file):
        for r in rows:
            rec = {k: v for k, v in r.items() if not k.startswith("_")}
            if len(seen[rec["judge"]]) > 1:
                rec["judge"] = f"{rec['judge']}#{n + 1}"
            verdict = normalize_verdict(rec.get("verdict"))
            if verdict is None and rec.get("verdict") is not None:
                rec["raw_verdict"] = str(rec["verdict"])
            rec["verdict"] = verdict
            out.append(rec)
    return out


def systems_of(records: Sequence[dict]) -> list[str]:
    """The system names in verdict records, in first-seen order."""
    return list(dict.fromkeys(n for r in records for n in (r["first"], r["second"])))


def elo_report(
    records: Sequence[dict], names: Sequence[str], n_resamples: int = 1000, seed: int = 0, prior: float = 1.0
) -> dict:
    """Elo per judge and pooled, with 95% item-bootstrap intervals and win/tie/loss counts.

    Also "spread": per system the mean, min and max of the per-judge ratings; "variants": per variant
    (see `variant_of`) the mean, min and max over its runs' per-judge ratings (Shaping Explanations' bars); and
    "invalid_verdicts": per judge, how many verdicts were not A/B/tie and what they were.
    """
    unknown = sorted({n for r in records for n in (r["first"], r["second"])} - set(names), key=str)
    if unknown:
        raise ValueError(f"verdicts name systems {unknown} that are not in {list(names)}")
    idx = {n: k for k, n in enumerate(names)}
    judges = list(dict.fromkeys(r["judge"] for r in records))
    invalid = sum(r["verdict"] is None for r in records)
    bad: dict[str, dict[str, int]] = {}
    for r in records:
        if r["verdict"] is None:  # what the judge said instead, for the table and the JSON
            what = str(r.get("raw_verdict", "(no verdict line)"))[:40]
            bad.setdefault(r["judge"], {})
            bad[r["judge"]][what] = bad[r["judge"]].get(what, 0) + 1

    def table(recs: list[dict]) -> dict:
        games = []
        wtl = {n: [0, 0, 0] for n in names}
        for r in recs:
            if r["verdict"] is None:
                continue
            s = {"A": 1.0, "B": 0.0, "tie": 0.5}[r["verdict"]]
            games.append((idx[r["first"]], idx[r["second"]], s, r["id"]))
            for n, v in ((r["first"], s), (r["second"], 1 - s)):
                wtl[n][0 if v == 1 else 1 if v == 0.5 else 2] += 1
        if not games:
            raise ValueError("no valid verdicts: check the judge (see the replies in the comparisons file)")
        fit = stats.elo_from_games(games, len(names), n_resamples, seed, prior)
        return {
            n: {
                "elo": float(fit["elo"][k]),
                "low": float(fit["low"][k]),
                "high": float(fit["high"][k]),
                "wins": wtl[n][0],
                "ties": wtl[n][1],
                "losses": wtl[n][2],
            }
            for n, k in idx.items()
        }

    per_judge = {j: table([r for r in records if r["judge"] == j]) for j in judges}
    spread = {}
    for n in names:
        e = [per_judge[j][n]["elo"] for j in judges]
        spread[n] = {"mean": float(np.mean(e)), "min": float(min(e)), "max": float(max(e))}
    variants: dict[str, dict] = {}
    for n in names:
        variants.setdefault(variant_of(n), {"runs": []})["runs"].append(n)
    for v in variants.values():
        e = [per_judge[j][n]["elo"] for j in judges for n in v["runs"]]
        v.update(mean=float(np.mean(e)), min=float(min(e)), max=float(max(e)), ratings=len(e))
    return {
        "systems": list(names),
        "judges": per_judge,
        "pooled": table(list(records)),
        "spread": spread,
        "variants": variants,
        "games": len(records) - invalid,
        "invalid": invalid,
        "invalid_verdicts": {
            j: {"count": sum(c.values()), "asked": sum(r["judge"] == j for r in records), "values": c}
            for j, c in bad.items()
        },
        "resamples": n_resamples,
        "seed": seed,
    }


def format_elo_table(report: dict) -> str:
    """Systems by pooled Elo: pooled rating with its 95% CI, W/T/L, then each judge's rating."""
    judges = list(report["judges"])
    head = f"{'system':<20}{'Elo':>7}  {'95% CI':<14}{'W/T/L':>14}" + "".join(f"{j[:14]:>16}" for j in judges)
    lines = [head]
    for n in sorted(report["systems"], key=lambda n: -report["pooled"][n]["elo"]):
        p = report["pooled"][n]
        wtl = f"{p['wins']}/{p['ties']}/{p['losses']}"
        row = f"{n[:20]:<20}{p['elo']:>7.1f}  [{p['low']:.0f}, {p['high']:.0f}]".ljust(43) + f"{wtl:>14}"
        lines.append(row + "".join(f"{report['judges'][j][n]['elo']:>16.1f}" for j in judges))
    variants = report.get("variants") or {}
    if any(len(v["runs"]) > 1 for v in variants.values()):
        lines += ["", f"{'variant':<20}{'Elo':>7}  {'min-max':<14}{'runs':>5}  (mean over judges and runs)"]
        for name, v in sorted(variants.items(), key=lambda kv: -kv[1]["mean"]):
            lines.append(
                f"{name[:20]:<20}{v['mean']:>7.1f}  [{v['min']:.0f}, {v['max']:.0f}]".ljust(43)
                + f"{len(v['runs']):>5}"
            )
    for j, bad in (report.get("invalid_verdicts") or {}).items():
        said = ", ".join(f"{k!r} x{c}" for k, c in sorted(bad["values"].items(), key=lambda kv: -kv[1])[:4])
        lines.append(
            f"{j}: {bad['count']} of {bad['asked']} verdicts not A/B/tie, dropped (not guessed): {said}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- accuracy against Elo


def read_accuracy(path: str | Path, metric: str = "em") -> float:
    """The mean of `metric` in a score summary (eval.py score --json) or over a scored JSONL's rows
    (eval.py score's .scored.jsonl: each row's `scores`); ValueError saying which file to pass."""
    path = Path(path)
    if path.suffix == ".json":
        m = json.loads(path.read_text()).get("metrics", {}).get(metric)
        if not isinstance(m, dict) or m.get("mean") is None:
            raise ValueError(
                f"{path} has no metrics.{metric}.mean: pass eval.py score --json output, or set --accuracy-metric"
            )
        return float(m["mean"])
    from nanogrpo.eval.evaluate import read_jsonl

    vals = [
        r["scores"][metric]
        for r in read_jsonl(path, require=("scores",))
        if r["scores"].get(metric) is not None
    ]
    if not vals:
        raise ValueError(
            f"{path}: no row has scores.{metric}; score it first (eval.py score) or set --accuracy-metric"
        )
    return float(np.mean(vals))


def accuracy_report(accuracy: dict[str, Sequence[float]], report: dict, metric: str) -> dict:
    """Per variant of the Elo report: accuracy mean, min and max over its runs' values (`accuracy` maps a
    system or a variant name to its runs' accuracies) beside its Elo mean, min and max."""
    variants = report["variants"]
    acc: dict[str, list[float]] = {}
    for name, vals in accuracy.items():
        v = name if name in variants else variant_of(name)
        if v not in variants:
            raise ValueError(
                f"--accuracy names {name!r}, which is not a system or variant of {list(variants)}"
            )
        acc.setdefault(v, []).extend(vals)
    out = {}
    for v, vals in acc.items():
        e = variants[v]
        out[v] = {"accuracy": float(np.mean(vals)), "acc_min": float(min(vals)), "acc_max": float(max(vals)),
                  "runs": len(vals), "elo": e["mean"], "elo_min": e["min"], "elo_max": e["max"]}  # fmt: skip
    return {"metric": metric, "variants": out}
