"""Pairwise judging of two or more systems' answers, and Elo ratings from the preferences (seed 000).

A judge is any callable `prefer(prompt, reference, answer_a, answer_b) -> 'A' | 'B' | 'tie'`. It sees no
system names (the answers are anonymous), and every pair is asked in both orders, so a judge that
favours the first position gives each system the same number of first positions and the bias cancels.
Each answer of a pair is one game; ratings are a Bradley-Terry fit on the Elo scale (nanogrpo.eval.stats)
with item-bootstrap intervals, per judge and pooled over judges.

Seed 000 reports the mean Elo over three judges with min-max bars across judges; `plot_elo` draws that.
Judges: `LLMJudge` (an OpenAI-compatible chat-completions server or a local model, through
rewards.llm_client) and `MetricJudge` (higher EM / F1 / SeqM / grader score wins; deterministic, for
tests and judge-free checks).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from nanogrpo.eval import stats
from nanogrpo.eval.evaluate import ANSWER_METRICS, grade, references
from rewards.rows import prompt_text

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

_VERDICT = re.compile(r"verdict\W*(a|b|tie)\b", re.IGNORECASE)


def parse_verdict(reply: str) -> str | None:
    """'A', 'B' or 'tie' from the judge's last 'Verdict: ...' line; None when there is none."""
    found = _VERDICT.findall(reply or "")
    if not found:
        return None
    v = found[-1].lower()
    return "tie" if v == "tie" else v.upper()


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

    def __call__(self, prompt: str, reference: str | None, answer_a: str, answer_b: str) -> str:
        return self.ask_many([(prompt, reference, answer_a, answer_b)])[0][0] or "tie"


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
    """Ask every judge about every pair of systems on every shared id, in both orders.

    Returns one record per question: id, judge, first, second (system names in the order shown),
    verdict ('A' | 'B' | 'tie' | None when the reply had no verdict) and, for LLM judges, the reply.
    """
    from tqdm import tqdm

    if len(systems) < 2:
        raise ValueError("pairwise judging needs at least two systems")
    by_id = {name: {r["id"]: r for r in rows} for name, rows in systems.items()}
    pairs = []  # (id, first, second): both orders of every pair
    for i in align(systems):
        for x, y in combinations(systems, 2):
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
        for (i, first, second), (verdict, reply) in zip(pairs, answers):
            assert verdict in ("A", "B", "tie", None), f"judge {jname} returned {verdict!r}"
            rec = {"id": i, "judge": jname, "first": first, "second": second, "verdict": verdict}
            records.append(rec if reply is None else {**rec, "reply": reply})
    return records


def elo_report(
    records: Sequence[dict], names: Sequence[str], n_resamples: int = 1000, seed: int = 0, prior: float = 1.0
) -> dict:
    """Elo per judge and pooled, with 95% item-bootstrap intervals and win/tie/loss counts.

    Also "spread": per system the mean, min and max of the per-judge ratings (seed 000's bars).
    """
    idx = {n: k for k, n in enumerate(names)}
    judges = list(dict.fromkeys(r["judge"] for r in records))
    invalid = sum(r["verdict"] is None for r in records)

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
    return {
        "systems": list(names),
        "judges": per_judge,
        "pooled": table(list(records)),
        "spread": spread,
        "games": len(records) - invalid,
        "invalid": invalid,
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
    if report["invalid"]:
        lines.append(f"({report['invalid']} replies without a verdict were dropped)")
    return "\n".join(lines)


def plot_elo(report: dict, path: str | Path) -> Path:
    """Bar plot: mean Elo over judges, min-max bars across judges (one judge: its 95% bootstrap CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(report["systems"], key=lambda n: report["spread"][n]["mean"])
    one = len(report["judges"]) == 1
    if one:
        fit = next(iter(report["judges"].values()))
        mid = [fit[n]["elo"] for n in names]
        lo, hi = [fit[n]["low"] for n in names], [fit[n]["high"] for n in names]
        what = "error bars: 95% bootstrap CI"
    else:
        mid = [report["spread"][n]["mean"] for n in names]
        lo, hi = [report["spread"][n]["min"] for n in names], [report["spread"][n]["max"] for n in names]
        what = f"error bars: min-max over {len(report['judges'])} judges"
    yerr = np.array([np.subtract(mid, lo), np.subtract(hi, mid)])  # (2, k)
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 3, 4))
    base = min(lo) - 30
    ax.bar(names, np.subtract(mid, base), bottom=base, yerr=yerr, capsize=5, color="#4c78a8")
    for x, m in enumerate(mid):
        ax.text(
            x, base + 4, f"{m:.1f}", ha="center", va="bottom", fontsize=9, color="white"
        )  # clear of the bars
    ax.axhline(1500, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("Elo")
    ax.set_title(f"Elo from pairwise preferences ({what})", fontsize=10)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
