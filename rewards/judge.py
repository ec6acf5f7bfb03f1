"""The group LLM judge (the graders guide) and its composites judge+similarity, judge+numbers.

One request per prompt carries the conversation, the reference reply and all G answers of the group,
so the judge marks them side by side, consistently relative to each other, which is what GRPO's
group-relative advantages use. Each answer gets 1-5 on correctness, helpfulness, tone and format and a
one-sentence reason; its score is the mean mark scaled to [0, 1]: (mean - 1) / 4.

Where this departs from the guide in the graders guide:
- the answers are shuffled with a permutation seeded by (--reward.judge.seed, prompt) and shown as
  Answer 1..G, so a position bias of the judge does not follow the sampler's order;
- the reply must be JSON; a reply that cannot be read gets one repair request (the judge sees its own
  reply and what was wrong with it); answers still without valid marks score None, counted in the
  metrics, and are never given a made-up score: a mark is an integer 1-5 (NaN, infinities, 4.5, 0 or
  6 are not clamped, they are no mark), and an answer marked twice in one reply has no mark;
- marks are cached per (prompt, reference, completion, judge settings), in a JSONL file when
  --reward.judge.cache is set (`with_run_dir` puts it in the run folder), so a resumed run or a
  second evaluation does not pay twice;
- a reason that holds the API key or a key-shaped string (a judge echoing its request) has it
  replaced by '[redacted]' before it is stored or cached (`redact_details`).

The per-answer marks and reason of the last call are in `grader.last_details` (one dict or None per
sample, aligned with the batch) for samples.jsonl and the run page; `metrics()` reports the tokens,
seconds, calls, retries, repairs, cache hits and unscored answers since the previous `metrics()`
(the reward function logs them as 'judge/prompt_tokens', ...).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rewards.base import Grader, Sample, transcript
from rewards.llm_client import ChatRequest, Reply, Slot, api_key, check_endpoint, make_client, redact
from rewards.options import JudgeConfig, RewardConfig
from rewards.registry import Mix, make, register

CRITERIA = ("correctness", "helpfulness", "tone", "format")

SYSTEM = (
    "You are a careful, impartial grader. You mark answers against a reference reply written by an expert."
)

TASK = """Below are a conversation, a reference reply written by an expert, and {n} candidate answers to the conversation's last message. The answers are in random order and their authors are anonymous.

Mark every answer from 1 (very poor) to 5 (excellent) on four criteria:
- correctness: are its facts, figures and conclusions right, judged against the reference reply?
- helpfulness: does it do what the user asked, completely and usefully?
- tone: does its tone suit the conversation, as the reference reply's does?
- format: is it well organised, of a sensible length, in the form the user or the reference expects?
An answer worded differently from the reference can still deserve 5. Judge the answers side by side: a better answer never gets lower marks than a worse one."""

REPLY_FORMAT = """Reply with only a JSON object with one entry for each of the {n} answers, in order, each with a one-sentence reason:
{{"answers": [{{"answer": 1, "correctness": <1-5>, "helpfulness": <1-5>, "tone": <1-5>, "format": <1-5>, "reason": "<one sentence>"}}, ...]}}"""

REPAIR = """Your reply could not be used: {problem}. Reply again with only the JSON object asked for, with an entry for each of the {n} answers."""


def _clip(text: str, n: int) -> str:
    """Cut to n characters and defuse closing tags, so an answer cannot end its own block early."""
    text = text if len(text) <= n else text[:n] + " [...]"
    return re.sub(r"</(conversation|reference|answer)", r"<\\/\1", text)


def render_group(prompt: str, reference: str, answers: list[str], max_chars: int) -> str:
    """The material block of a judge prompt: conversation, reference and the numbered answers."""
    parts = [
        f"<conversation>\n{_clip(prompt, 4 * max_chars)}\n</conversation>",
        f"<reference>\n{_clip(reference or '(none given)', max_chars)}\n</reference>",
    ]
    parts += [f'<answer id="{k}">\n{_clip(a, max_chars)}\n</answer>' for k, a in enumerate(answers, 1)]
    return "\n\n".join(parts)


_SPACES = re.compile(r"\s*")


def fenced_blocks(text: str) -> list[str]:
    """The contents of the ``` (or ```json) fenced blocks of a reply, left to right, without the
    whitespace after the opening fence.

    Found with str.find, in time linear in the reply: the regular expression that did this,
    '```(?:json)?\\s*(.*?)```', retried every split of the spaces after an unclosed fence against the rest
    of the reply (3 s for 16 KB; 64 KB did not finish in minutes). The blocks are the ones it found.
    """
    out, pos = [], 0
    while (start := text.find("```", pos)) >= 0:
        start += 3
        if text.startswith("json", start):
            start += 4
        start = _SPACES.match(text, start).end()
        end = text.find("```", start)
        if end < 0:  # an unclosed fence: no later fence can close either (no ``` after this point)
            break
        out.append(text[start:end])
        pos = end + 3
    return out


def extract_json(text: str) -> Any:
    """The JSON value in a reply: the whole text, a ```json fence, or the outermost {...} / [...].

    Linear in the reply: each candidate is a slice of it read once by json.loads (C, linear), and the
    fences are found by `fenced_blocks`."""
    cands = [text, *fenced_blocks(text)]
    spans = [(text.find(o), text.rfind(c)) for o, c in ("{}", "[]")]
    cands += [text[i : j + 1] for i, j in sorted(spans) if 0 <= i < j]  # the outermost first
    for c in cands:
        try:
            return json.loads(c)
        except (ValueError, RecursionError):  # RecursionError: '[[[[...' nested past Python's stack
            continue
    return None


def _mark(v: Any, lo: int, hi: int) -> int | None:
    """An integer mark in [lo, hi] from a number or a numeric string, else None (NaN and inf too:
    JSON from a server may hold NaN and Infinity, and a mark outside the scale is never clamped)."""
    if isinstance(v, str):
        v = v.strip()
        v = float(v) if re.fullmatch(r"\d{1,9}(\.0*)?", v) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or v != int(v):
        return None  # the range test first: it is False for NaN, and int() of NaN or inf raises
    return int(v)


def marks_schema(n: int) -> dict[str, Any]:
    """The JSON schema of a reply marking n answers (sent with --reward.judge.json-mode schema)."""
    mark = {"type": "integer", "enum": [1, 2, 3, 4, 5]}
    item = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "enum": list(range(1, n + 1))}}
        | dict.fromkeys(CRITERIA, mark)
        | {"reason": {"type": "string", "maxLength": 300}},
        "required": ["answer", *CRITERIA, "reason"],
        "additionalProperties": False,
    }
    answers = {"type": "array", "items": item, "minItems": n, "maxItems": n}
    return {
        "type": "object",
        "properties": {"answers": answers},
        "required": ["answers"],
        "additionalProperties": False,
    }


def marks_shape(n: int) -> list[str | Slot]:
    """The reply as literal text and slots, for a local model to fill (constrained decoding)."""
    shape: list[str | Slot] = ['{"answers": [']
    for k in range(1, n + 1):
        shape.append(f'{", " if k > 1 else ""}{{"answer": {k}')
        for c in CRITERIA:
            shape += [f', "{c}":', Slot(marks=(1, 2, 3, 4, 5))]
        shape += [', "reason": "', Slot(max_tokens=48), '"}']
    return [*shape, "]}"]


def parse_group_marks(text: str, n: int) -> tuple[list[dict | None], str]:
    """Per shown answer {marks, reason, score} or None, and what was wrong ('' when all n are fine)."""
    obj = extract_json(text)
    if isinstance(obj, dict) and isinstance(obj.get("answers"), list):
        items = obj["answers"]
    elif isinstance(obj, list):
        items = obj
    else:
        return [None] * n, "it is not a JSON object with an 'answers' list"
    out: list[dict | None] = [None] * n
    seen: Counter = Counter()  # an answer marked twice is ambiguous: neither marking is used
    for pos, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        k = _mark(item.get("answer", pos + 1), 1, n)  # the answer number, 1..n
        seen[k] += 1
        marks = {c: _mark(item.get(c), 1, 5) for c in CRITERIA}
        if k is None or any(m is None for m in marks.values()):
            continue
        mean = sum(marks.values()) / len(marks)
        why = item.get("reason", "")
        why = why if isinstance(why, str) else str(why) if isinstance(why, (int, float)) else ""
        reason = redact(" ".join(why.split()))[:300]  # key-shaped strings out before it is stored
        out[k - 1] = {"marks": marks, "reason": reason, "score": (mean - 1) / 4}
    out = [None if seen[k] > 1 else d for k, d in enumerate(out, 1)]
    missing = [str(k + 1) for k, d in enumerate(out) if d is None]
    problem = f"no valid marks (integers 1-5 for {', '.join(CRITERIA)}) for answer(s) {', '.join(missing)}"
    return out, problem if missing else ""


def redact_details(details: dict, key: str = "") -> dict:
    """A judgement's details with every text in them redacted (rewards.llm_client.redact): the key of
    the judge server, and key-shaped strings, never reach samples.jsonl, the run page or the cache."""
    return {k: redact(v, key) if isinstance(v, str) else v for k, v in details.items()}


class JudgeCache:
    """Judgements by key, kept in memory and appended to a JSONL file; no path, no cache (nothing kept)."""

    def __init__(self, path: str = ""):
        self.path = Path(path) if path else None
        self.mem: dict[str, dict] = {}
        if self.path and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    item = json.loads(line)
                    self.mem[item["key"]] = item["value"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a crash mid-write: that judgement is simply paid again

    def get(self, key: str) -> dict | None:
        return self.mem.get(key)

    def put(self, items: dict[str, dict]) -> None:
        if self.path is None or not items:
            return
        self.mem.update(items)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps({"key": k, "value": v}) + "\n" for k, v in items.items())


def with_run_dir(cfg: RewardConfig, run_dir: str | Path) -> RewardConfig:
    """cfg with the judge cache in the run folder (unless a cache file was set explicitly)."""
    if cfg.judge.cache:
        return cfg
    return replace(cfg, judge=replace(cfg.judge, cache=str(Path(run_dir) / "judge_cache.jsonl")))


@dataclass
class _Job:
    idxs: list[int]  # batch indices of the group, in batch order
    perm: list[int]  # shown answer k is the group's answer perm[k]
    messages: list[dict[str, str]]


class GroupJudge(Grader):
    """The shared machinery of the group judges: grouping, shuffling, cache, repair, metering.

    Subclasses give the prompt (`messages`), the request (`request`) and the reader of a reply
    (`read`: per shown answer a detail dict holding 'score', or None, and the problem found).
    """

    name = "judge"
    requires = ("reference",)

    def __init__(self, cfg: JudgeConfig, client: Any = None):
        self.cfg = cfg
        self._client = client
        self.cache = JudgeCache(cfg.cache)
        self.last_details: list[dict | None] = []
        self.counts: Counter = Counter()

    @property
    def client(self) -> Any:
        if self._client is None:  # built on first use: a local judge loads its model only if called
            self._client = make_client(self.cfg)
        return self._client

    def check(self) -> None:
        if self._client is None:  # a client handed in (a shared local model, a test's stub) is not checked
            check_endpoint(self.cfg)

    # -- what a subclass defines -------------------------------------------------------------
    task = TASK
    """The instructions, before the material; '{n}' is the number of answers."""

    def reply_format(self, n: int) -> str:
        return REPLY_FORMAT.format(n=n)

    def messages(self, prompt: str, reference: str, answers: list[str]) -> list[dict[str, str]]:
        n = len(answers)
        body = render_group(prompt, reference, answers, self.cfg.max_answer_chars)
        user = f"{self.task.format(n=n)}\n\n{body}\n\n{self.reply_format(n)}"
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def request(self, messages: list[dict[str, str]], n: int) -> ChatRequest:
        return ChatRequest(
            messages,
            max_tokens=self.cfg.max_tokens or 100 * n + 100,
            json_mode=True,
            json_schema=marks_schema(n),
            shape=marks_shape(n),
        )

    def read(self, reply: Reply, n: int) -> tuple[list[dict | None], str]:
        return parse_group_marks(reply.text if isinstance(reply.text, str) else "", n)

    # -- the shared flow ---------------------------------------------------------------------
    def fingerprint(self) -> str:
        """What changes a judgement: the prompt wording and the judge settings (not URLs or timeouts)."""
        c = self.cfg
        prompt = (self.name, SYSTEM, self.task, self.reply_format(2), REPAIR)
        settings = (c.backend, c.model, c.temperature, c.max_tokens, c.extra_body, c.json_mode)
        parts = prompt + settings + (c.max_answer_chars, c.seed, c.top_logprobs)
        return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()

    def key(self, s: Sample, fingerprint: str = "") -> str:
        payload = [
            fingerprint or self.fingerprint(),
            s.prompt,
            str(s.row.get("reference") or ""),
            transcript(s),
        ]
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()

    def _permutation(self, prompt: str, n: int) -> list[int]:
        rng = random.Random(f"{self.cfg.seed}:{hashlib.sha256(prompt.encode()).hexdigest()}")
        perm = list(range(n))
        rng.shuffle(perm)
        return perm

    def _ask(self, reqs: list[ChatRequest]) -> list[Reply]:
        replies = self.client.chat(reqs)
        for r in replies:
            self.counts["calls"] += 1
            self.counts["retries"] += r.retries
            self.counts["prompt_tokens"] += r.prompt_tokens
            self.counts["completion_tokens"] += r.completion_tokens
        return replies

    def score(self, batch: list[Sample]) -> list[float | None]:
        t0 = time.perf_counter()
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(batch):
            groups.setdefault(s.group, []).append(i)
        details: list[dict | None] = [None] * len(batch)
        fp = self.fingerprint()
        secret = api_key(self.cfg)  # a client handed in may not redact it: every judge does, here
        keys = [self.key(s, fp) for s in batch]
        jobs: list[_Job] = []
        for idxs in groups.values():
            hits = [self.cache.get(keys[i]) for i in idxs]
            if all(h is not None for h in hits):
                for i, h in zip(idxs, hits):
                    details[i] = redact_details(dict(h, cached=True), secret)  # a cache of an older version
                self.counts["cached"] += len(idxs)
                continue
            s0 = batch[idxs[0]]  # the group shares its prompt and reference: judge it as a whole again
            perm = self._permutation(s0.prompt, len(idxs))
            answers = [transcript(batch[idxs[p]]) for p in perm]  # an episode: its whole transcript
            jobs.append(
                _Job(idxs, perm, self.messages(s0.prompt, str(s0.row.get("reference") or ""), answers))
            )

        replies = self._ask([self.request(j.messages, len(j.idxs)) for j in jobs])
        parsed = []
        for j, r in zip(jobs, replies):
            parsed.append(self.read(r, len(j.idxs)) if r.text is not None else ([None] * len(j.idxs), ""))
        # one repair request for each reply that came back but could not be fully read
        fix = [k for k, (_, problem) in enumerate(parsed) if problem and replies[k].text is not None]
        repair_reqs = []
        for k in fix:
            n = len(jobs[k].idxs)
            msgs = jobs[k].messages + [
                {"role": "assistant", "content": replies[k].text or ""},
                {"role": "user", "content": REPAIR.format(problem=parsed[k][1], n=n)},
            ]
            repair_reqs.append(self.request(msgs, n))
        self.counts["repairs"] += len(repair_reqs)
        for k, r in zip(fix, self._ask(repair_reqs)):
            if r.text is not None:
                second, _ = self.read(r, len(jobs[k].idxs))
                parsed[k] = ([b if b is not None else a for a, b in zip(parsed[k][0], second)], "")

        fresh = {}
        for j, r, (shown, _) in zip(jobs, replies, parsed):
            for pos, d in enumerate(shown):
                i = j.idxs[j.perm[pos]]
                if d is None:
                    self.counts["failed" if r.text is None else "unparsable"] += 1
                    continue
                details[i] = redact_details(dict(d, position=pos + 1), secret)
                fresh[keys[i]] = details[i]
        self.cache.put(fresh)
        self.counts["seconds"] += time.perf_counter() - t0
        self.counts["answers"] += len(batch)
        self.last_details = details
        return [d["score"] if d is not None else None for d in details]

    def metrics(self) -> dict[str, float]:
        """Cost and failure counts since the previous call (a step)."""
        keys = ("calls", "prompt_tokens", "completion_tokens", "seconds", "retries", "repairs")
        keys += ("cached", "unparsable", "failed")
        out = {k: float(self.counts[k]) for k in keys}
        self.counts.clear()
        return out


class Judge(GroupJudge):
    """The group judge: four 1-5 marks and a reason per answer; score = (mean mark - 1) / 4."""


class JudgeMix(Mix):
    """A named blend whose first part is a judge: the judge alone where the other part gives None.

    Where the judge gives None the blend is None too (not the other part alone): the judge is the part
    that reads meaning, and a similarity-only score for some answers of a group would not be
    comparable with the judged answers next to it.
    """

    def score(self, batch: list[Sample]) -> list[float | None]:
        out = super().score(batch)  # the weighted mean, renormalised where the other part is None
        judge = self.parts[0][0]
        return [None if j is None else s for s, j in zip(out, self.last_components[judge.name])]

    @property
    def last_details(self) -> list[dict | None]:
        return getattr(self.parts[0][0], "last_details", [])


@register("judge")
def _judge(cfg: RewardConfig) -> Grader:
    return Judge(cfg.judge)


@register("judge+similarity")
def _judge_similarity(cfg: RewardConfig) -> Grader:
    return JudgeMix("judge+similarity", [(make("judge", cfg), 0.7), (make("rouge_l", cfg), 0.3)])


@register("judge+numbers")
def _judge_numbers(cfg: RewardConfig) -> Grader:
    return JudgeMix("judge+numbers", [(make("judge", cfg), 0.5), (make("numbers", cfg), 0.5)])
