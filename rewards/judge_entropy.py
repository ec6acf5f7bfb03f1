"""The entropy-normalised judge of Concept Overlap, and an expected-score variant.

The judge sees the group as in rewards/judge.py but gives each answer one overall mark from 0 to 5,
written as the JSON object {"Answer 1": m1, "Answer 2": m2, ...}. At the position where it writes
answer k's mark we read its probabilities p_0..p_5 of the six score tokens: from the logits with the
local backend, from `top_logprobs` with an OpenAI-compatible server (a server that returns none is
an error, with the fix). Then, per answer:

- `judge_entropy`: 1 - H(p) / log2 6, H(p) = -sum_k p_k log2 p_k  (Concept Overlap, Eq. for R_judge);
- `judge_entropy_expected`: E[mark] / 5 = sum_k k p_k / 5.

Read what the first one measures: the judge's certainty, not the answer's quality. A judge sure that
an answer deserves 0 gives it reward 1. Concept Overlap uses it inside a composite with concept overlap and
a consistency term (SEED002_SPEC below); the expected-score variant is the one that rewards quality,
with the judge's uncertainty softening the mark instead of being rewarded for its own sake.

Departures: the score-token probabilities are renormalised over the six digits found among the
returned alternatives (the mass on other tokens is dropped; its mean is logged as `.../digit_mass`,
from the sum and count that `metrics()` returns);
tokens that decode to the same digit (" 4", "4") are summed. An answer whose mark position cannot be
found in the reply, is found twice, holds a digit outside 0-5 or log-probs that are not log-probs
(NaN, +inf, positive, not numbers) scores None, counted as unparsable, after one repair request.
"""

from __future__ import annotations

import math
import re

from rewards.base import Grader
from rewards.judge import GroupJudge, extract_json
from rewards.llm_client import ChatRequest, JudgeServerError, Reply, Slot, TokenLogprob
from rewards.options import RewardConfig
from rewards.registry import register

SEED002_SPEC = "judge_entropy:0.6,concepts:0.3,consistency:0.1"
"""Concept Overlap's composite reward: 0.6 entropy-normalised judge, 0.3 concept overlap, 0.1 consistency."""

MARKS = 6  # the score tokens 0..5

TASK = """Below are a conversation, a reference reply written by an expert, and {n} candidate answers to the conversation's last message. The answers are in random order and their authors are anonymous.

Give every answer one overall mark from 0 to 5 for correctness, helpfulness, tone and format together, judged against the reference reply: 0 = useless or wrong, 3 = acceptable, 5 = as good as the reference. An answer worded differently from the reference can still deserve 5."""

REPLY_FORMAT = """Reply with only a JSON object that maps each of the {n} answers to its mark:
{example}"""

_DIGIT = re.compile(r"""[\s:="'{},]*([0-9])[\s:="'{},]*""")
# answer k, a quote, a colon, a quote, with any spaces between, at the end of the text before a mark. Each
# run of spaces is one \s*: '\s*["\']?\s*' would split every run of spaces between its two \s* (a reply
# whose mark token holds 64 KB of spaces: minutes), '\s*(?:["\']\s*)?' takes the same texts in one pass
_BEFORE_MARK = re.compile(r"""answer\s*(\d{1,9})\s*(?:["']\s*)?[:=]\s*(?:["']\s*)?$""", re.I)


def marks_schema(n: int) -> dict:
    """{"Answer 1": 0..5, ...}: the reply's JSON schema (sent with --reward.judge.json-mode schema)."""
    keys = [f"Answer {k}" for k in range(1, n + 1)]
    props = {k: {"type": "integer", "enum": list(range(MARKS))} for k in keys}
    return {"type": "object", "properties": props, "required": keys, "additionalProperties": False}


def marks_shape(n: int) -> list[str | Slot]:
    """{"Answer 1": m, ...} as literal text and mark slots, for a local model to fill."""
    shape: list[str | Slot] = []
    for k in range(1, n + 1):
        shape += [f'{", " if k > 1 else "{"}"Answer {k}":', Slot(marks=tuple(range(MARKS)))]
    return [*shape, "}"]


def _digit(token: str) -> int | None:
    m = _DIGIT.fullmatch(token)
    return int(m.group(1)) if m else None


def mark_distributions(tokens: list[TokenLogprob], n: int) -> tuple[list[list[float] | None], list[float]]:
    """For answers 1..n, p_0..p_5 at the token where the reply writes that answer's mark.

    A mark token is a token that is one digit (give or take spaces, quotes and punctuation) right
    after 'Answer k":'. Returns the distributions (None where not found) and the digit mass found.
    """
    found: dict[int, list[list[float] | None]] = {}  # answer k -> what each of its mark tokens gave
    mass: list[float] = []
    text = ""  # the last 200 characters of the reply so far: a hostile reply may be long
    for t in tokens:
        d = _digit(t.token)
        if d is not None:
            lead = t.token[: t.token.index(str(d))]
            m = _BEFORE_MARK.search(text + lead)
            k = int(m.group(1)) if m else 0
            if 1 <= k <= n:
                found.setdefault(k, []).append(_distribution(t, d))
        text = (text + t.token)[-200:]  # bounded, so the reply costs linear time however many tokens
    out: list[list[float] | None] = [None] * n
    for k, dists in found.items():
        if len(dists) == 1 and dists[0] is not None:  # a mark written twice is ambiguous: None
            out[k - 1] = [x / sum(dists[0]) for x in dists[0]]
            mass.append(sum(dists[0]))
    return out, mass


def _distribution(t: TokenLogprob, d: int) -> list[float] | None:
    """p_0..p_5 (not yet normalised) at a mark token whose digit is d; None when it cannot be read:
    a mark outside 0-5, a log-prob that is not one (NaN: see parse_logprobs), no mass on the marks."""
    alts = dict(t.top) or {t.token: t.logprob}
    if d >= MARKS or any(lp != lp for lp in alts.values()):
        return None
    p = [0.0] * MARKS
    for alt, lp in alts.items():
        a = _digit(alt)
        if a is not None and a < MARKS:
            p[a] += math.exp(lp)
    return p if sum(p) > 0 else None


def entropy_score(p: list[float]) -> float:
    """Concept Overlap: 1 - H(p) / log2 6 (1 = a certain judge, 0 = a uniform one)."""
    h = -sum(x * math.log2(x) for x in p if x > 0)
    return 1.0 - h / math.log2(MARKS)


def expected_score(p: list[float]) -> float:
    return sum(k * x for k, x in enumerate(p)) / (MARKS - 1)


class EntropyJudge(GroupJudge):
    """One 0-5 mark per answer; the score is read from the judge's probabilities of the mark tokens."""

    name = "judge_entropy"

    def __init__(self, cfg, client=None, expected: bool = False):
        super().__init__(cfg, client)
        self.expected = expected
        if expected:
            self.name = "judge_entropy_expected"
        self.digit_mass: list[float] = []

    task = TASK

    def reply_format(self, n: int) -> str:
        example = "{" + ", ".join(f'"Answer {k}": <0-5>' for k in range(1, n + 1)) + "}"
        return REPLY_FORMAT.format(n=n, example=example)

    def request(self, messages: list[dict[str, str]], n: int) -> ChatRequest:
        # marks only: a few tokens per answer; the alternatives of every token come back with them
        k = max(1, self.cfg.top_logprobs)
        return ChatRequest(
            messages,
            max_tokens=min(self.cfg.max_tokens or 10**6, 12 * n + 16),
            json_mode=True,
            json_schema=marks_schema(n),
            shape=marks_shape(n),
            top_logprobs=k,
        )

    def read(self, reply: Reply, n: int) -> tuple[list[dict | None], str]:
        if reply.tokens is None:  # the server does not return them: no retry or later step will do better
            raise JudgeServerError(
                f"{self.name} needs the log-probs of the judge's tokens, and the judge server returned none "
                "(no logprobs.content in the reply). Use a server that returns top_logprobs (vLLM, SGLang, "
                "llama-cpp-python's server started with --logits_all true, OpenAI), or "
                "--reward.judge.backend local."
            )
        dists, mass = mark_distributions(reply.tokens, n)
        self.digit_mass += mass
        obj = extract_json(reply.text or "")
        written = {}
        if isinstance(obj, dict):
            for key, v in obj.items():
                m = re.fullmatch(r"\s*answer\s*(\d{1,9})\s*", str(key), re.I)
                if m and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < MARKS:
                    written[int(m.group(1))] = v  # shown in the details only; the score is the probabilities
        out: list[dict | None] = []
        for k, p in enumerate(dists, 1):
            if p is None:
                out.append(None)
                continue
            score = expected_score(p) if self.expected else entropy_score(p)
            h = -sum(x * math.log2(x) for x in p if x > 0)
            out.append(
                {"mark": written.get(k), "probs": [round(x, 4) for x in p], "entropy": h, "score": score}
            )
        missing = [str(k) for k, d in enumerate(out, 1) if d is None]
        problem = f"no mark from 0 to 5 for answer(s) {', '.join(missing)}" if missing else ""
        return out, problem

    def metrics(self) -> dict[str, float]:
        # a sum and a count, present when no mark was read too: torchrun sums metrics key by key over
        # ranks, and `mean_metrics` turns the pair into the mean 'digit_mass' after that sum
        out = super().metrics()
        out["digit_mass_sum"], out["digit_mass_n"] = float(sum(self.digit_mass)), float(len(self.digit_mass))
        self.digit_mass = []
        return out


@register("judge_entropy")
def _judge_entropy(cfg: RewardConfig) -> Grader:
    return EntropyJudge(cfg.judge)


@register("judge_entropy_expected")
def _judge_entropy_expected(cfg: RewardConfig) -> Grader:
    return EntropyJudge(cfg.judge, expected=True)
