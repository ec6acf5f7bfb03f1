"""Rubric judges (Small-LM Judges): a verdict per criterion of the row's rubric, weighted into one score.

A row carries `"rubric": [{"criterion": "Names the drug class", "weight": 2}, ...]`. Each (answer,
criterion) pair gets a verdict v in [0, 1] from one of three readouts (--reward.rubric.readout):

- 'generative': the judge model answers the question below with Yes or No; v = 1 / 0; a reply that
  starts with neither gives None for that criterion.
- 'logprob': one token is generated; from its top alternatives, P(Yes) and P(No) (summed over case
  and spacing variants); the margin log P(Yes) - log P(No) > 0 gives v = 1 (with --reward.rubric.soft,
  v = P(Yes) / (P(Yes) + P(No))). Needs a server that returns top_logprobs, or the local backend.
- 'probe': a linear probe on a frozen small LM's last-token hidden state (rewards/probe), trained with
  `python -m rewards.probe train`; v = 1 when P(met) >= the probe's dev-tuned threshold (or P(met)
  with --reward.rubric.soft). No generation at all: one forward pass per (answer, criterion).

The generative and logprob readouts use the --reward.judge.* backend (server or local model).

Score. With S = sum_i w_i v_i over the criteria with a verdict, P = the sum of their positive weights
and N = the sum of |w| over their negative weights (pitfalls: "invents a citation", weight -2):

    score = (S + N) / (P + N)  in [0, 1]

so meeting every positive criterion and no pitfall gives 1, meeting none and every pitfall gives 0,
and a rubric of pitfalls only scores 1 for avoiding them all. With no pitfalls this is the usual
weighted share S / P. Criteria without a verdict drop out of S, P and N; none at all -> None.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections import Counter
from typing import Any

from rewards.base import Grader, Sample, transcript
from rewards.judge import JudgeCache
from rewards.llm_client import ChatRequest, JudgeServerError, check_endpoint, make_client
from rewards.options import RewardConfig
from rewards.registry import register

SYSTEM = "You check whether a response meets one criterion of a rubric. Answer with Yes or No only."

CRITERION = """Question:
{prompt}

Response:
{response}

Criterion: {criterion}

Does the response meet the criterion? Answer Yes or No."""


def criterion_messages(prompt: str, response: str, criterion: str) -> list[dict[str, str]]:
    """The Yes/No question of the generative and logprob readouts, and the text a probe reads."""
    user = CRITERION.format(prompt=prompt, response=response, criterion=criterion)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def parse_rubric(value: Any) -> list[tuple[str, float]]:
    """[{criterion, weight}] -> [(criterion, weight)]; ValueError saying what is wrong."""
    if not isinstance(value, list) or not value:
        raise ValueError('must be a non-empty list of {"criterion": "...", "weight": number}')
    out = []
    for k, item in enumerate(value):
        c = item.get("criterion") if isinstance(item, dict) else None
        w = item.get("weight", 1.0) if isinstance(item, dict) else None
        if not isinstance(c, str) or not c.strip():
            raise ValueError(f"item {k} needs a non-empty string 'criterion'")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"item {k} ('{c[:40]}') needs a number 'weight' (negative for a pitfall)")
        out.append((c, float(w)))
    if all(w == 0 for _, w in out):
        raise ValueError("has only zero weights; give the criteria that count a weight")
    return out


def rubric_score(verdicts: list[float | None], weights: list[float]) -> float | None:
    """(S + N) / (P + N): see the module docstring. None when no weighted criterion has a verdict."""
    avail = [(v, w) for v, w in zip(verdicts, weights) if v is not None and w != 0]
    if not avail:
        return None
    pos = sum(w for _, w in avail if w > 0)
    neg = sum(-w for _, w in avail if w < 0)
    return (sum(v * w for v, w in avail) + neg) / (pos + neg)


def parse_yes_no(text: str) -> float | None:
    """1.0 for a reply that starts with yes, 0.0 for no (any case, markdown or quotes around), else None."""
    m = re.match(r"[\s\"'*_`(\[]*(yes|no)\b", text, re.I)
    return None if m is None else float(m.group(1).lower() == "yes")


def yes_no_probs(top: dict[str, float]) -> tuple[float, float]:
    """P(Yes), P(No) from one position's alternatives (tokens ' Yes', 'yes', 'YES' summed)."""
    p = {"yes": 0.0, "no": 0.0}
    for tok, lp in top.items():
        t = tok.strip(" \t\n\"'*_`").lower()
        if t in p:
            p[t] += math.exp(lp)
    return p["yes"], p["no"]


class Rubric(Grader):
    """The weighted rubric score of each answer; per-criterion verdicts in `last_details`."""

    name = "rubric"
    requires = ("rubric",)

    def __init__(self, cfg: RewardConfig, client: Any = None):
        self.cfg, self.readout = cfg, cfg.rubric.readout
        if self.readout not in ("generative", "logprob", "probe"):
            raise ValueError(
                f"--reward.rubric.readout must be generative, logprob or probe, got {self.readout!r}"
            )
        if self.readout == "probe" and not cfg.rubric.probe:
            raise ValueError(
                "--reward.rubric.readout probe needs --reward.rubric.probe DIR (python -m rewards.probe train)"
            )
        self._client, self._probe = client, None
        self.cache = JudgeCache(cfg.judge.cache)
        self.last_details: list[dict | None] = []
        self.counts: Counter = Counter()

    def check_row(self, row: dict[str, Any]) -> tuple[str, str] | None:
        try:
            parse_rubric(row.get("rubric"))
        except ValueError as e:
            return "rubric", str(e)
        return None

    def check(self) -> None:
        """At start-up: the judge server answers, or (probe readout, in-process) the probe loads, so a
        missing or stale probe stops the run before the model loads, not at the first scoring."""
        if self.readout == "probe":
            _ = self.probe  # Probe.load: ValueError with the command that trains one
        elif self._client is None:
            check_endpoint(self.cfg.judge)

    @property
    def probe(self) -> Any:
        if self._probe is None:
            from rewards.probe import Probe

            self._probe = Probe.load(self.cfg.rubric.probe)
        return self._probe

    def _key(self, s: Sample, criterion: str) -> str:
        j = self.cfg.judge
        setting = [
            self.readout,
            self.cfg.rubric.probe,
            j.backend,
            j.model,
            j.temperature,
            j.top_logprobs,
            j.extra_body,
            SYSTEM,
            CRITERION,
        ]
        payload = [str(x) for x in setting] + [s.prompt, transcript(s), criterion]
        return hashlib.sha256(json.dumps(["rubric", *payload]).encode()).hexdigest()

    def _ask(self, items: list[tuple[Sample, str]]) -> list[float | None]:
        """P(criterion met) per (sample, criterion): 0/1 for generative, a probability otherwise."""
        if self.readout == "probe":
            rows = [{"prompt": s.prompt, "response": transcript(s), "criterion": c} for s, c in items]
            return self.probe.predict_proba(rows, self.cfg.rubric.batch_size, self.cfg.judge.device)
        if self._client is None:
            self._client = make_client(self.cfg.judge)
        gen = self.readout == "generative"
        k = 0 if gen else max(1, self.cfg.judge.top_logprobs)
        reqs = [
            ChatRequest(criterion_messages(s.prompt, transcript(s), c), 8 if gen else 1, top_logprobs=k)
            for s, c in items
        ]
        out: list[float | None] = []
        for r in self._client.chat(reqs):
            self.counts["calls"] += 1
            self.counts["retries"] += r.retries
            self.counts["prompt_tokens"] += r.prompt_tokens
            self.counts["completion_tokens"] += r.completion_tokens
            if r.text is None:
                self.counts["failed"] += 1
                out.append(None)
            elif gen:
                out.append(parse_yes_no(r.text) if isinstance(r.text, str) else None)
            elif r.tokens is None:  # the server does not return them: no retry or later step will do better
                raise JudgeServerError(
                    "rubric readout 'logprob' needs top_logprobs, and the judge server returned none; use a server "
                    "that returns them, --reward.judge.backend local, or --reward.rubric.readout generative"
                )
            else:  # no token, or alternatives that cannot be read (NaN: see parse_logprobs): no verdict
                y, n = yes_no_probs(r.tokens[0].top) if r.tokens else (0.0, 0.0)
                out.append(y / (y + n) if math.isfinite(y + n) and y + n > 0 else None)
        return out

    def score(self, batch: list[Sample]) -> list[float | None]:
        t0 = time.perf_counter()
        rubrics = []
        for s in batch:
            try:
                rubrics.append(parse_rubric(s.row.get("rubric")))
            except ValueError:
                rubrics.append([])  # checked at start-up; a bad row met later is simply not graded
        keys = {(i, c): self._key(s, c) for i, s in enumerate(batch) for c, _ in rubrics[i]}
        got = {k: hit["p"] for k in keys.values() if (hit := self.cache.get(k)) is not None}
        todo = [(i, c) for (i, c), k in keys.items() if k not in got]
        self.counts["cached"] += len(keys) - len(todo)
        fresh = {}
        for (i, c), p in zip(todo, self._ask([(batch[i], c) for i, c in todo])):
            if p is None:
                self.counts["unparsable"] += 1
            else:
                got[keys[(i, c)]] = p
                fresh[keys[(i, c)]] = {"p": p}
        self.cache.put(fresh)
        hard = self.probe.threshold if self.readout == "probe" else 0.5
        scores, details = [], []
        for i, crit in enumerate(rubrics):
            verdicts = []
            for c, _ in crit:
                p = got.get(keys[(i, c)])
                verdicts.append(None if p is None else p if self.cfg.rubric.soft else float(p >= hard))
            s = rubric_score(verdicts, [w for _, w in crit]) if crit else None
            scores.append(s)
            rows = [{"criterion": c, "weight": w, "verdict": v} for (c, w), v in zip(crit, verdicts)]
            details.append({"criteria": rows, "score": s} if crit else None)
        self.last_details = details
        self.counts["seconds"] += time.perf_counter() - t0
        return scores

    def metrics(self) -> dict[str, float]:
        keys = (
            "calls",
            "prompt_tokens",
            "completion_tokens",
            "seconds",
            "retries",
            "cached",
            "unparsable",
            "failed",
        )
        out = {k: float(self.counts[k]) for k in keys}
        self.counts.clear()
        return out


@register("rubric")
def _rubric(cfg: RewardConfig) -> Grader:
    return Rubric(cfg)
