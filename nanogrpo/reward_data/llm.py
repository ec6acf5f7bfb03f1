"""Asking the drafting LLM: the judges' client, a reply cache, one repair, token counts and a cost estimate.

Every LLM subcommand goes through `Drafter`. Requests go to rewards.llm_client (concurrency, retries,
backoff and timeouts from the --llm.* options, the same JudgeConfig the judges use). Each reply that
came back is cached by what produced it (the model settings and the whole conversation, so the row and
the prompt wording), in a JSONL file next to the output by default: a build that stops half-way, or is
run again, asks only what it has not asked before. With temperature 0 the replay is exact: a repair
request holds the bad reply it repairs, so it hits the cache too.

`draft` is the flow every step of a build uses: one request per conversation, each reply read by a
reader that returns (value, problem); a reply with a problem gets ONE repair request, the conversation
plus the bad reply plus what was wrong with it; a reply still bad after that comes back with its
problem, and the caller reports the row and leaves it out. A request that fails after its retries (a
server gone) comes back as a problem too and is not cached, so a rerun asks again.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import tyro

from nanogrpo.reward_data import rows as io
from nanogrpo_base.ranges import at_least
from rewards.judge import JudgeCache, extract_json
from rewards.llm_client import ChatRequest, Reply, check_endpoint, make_client
from rewards.options import JudgeConfig

Messages = list[dict[str, str]]
Reader = Callable[[str], tuple[Any, str]]
"""A reply's text -> (value, problem): problem '' when the value is good, else what to fix."""

REPAIR = (
    "Your reply could not be used: {problem}. Reply again with only the JSON object asked for, "
    "fixing that and keeping everything else the rules allow."
)


def read_json_object(text: str) -> tuple[dict[str, Any] | None, str]:
    """The JSON object in a reply (whole, fenced, or the outermost braces), or the problem."""
    obj = extract_json(text)
    if not isinstance(obj, dict):
        return None, "it is not a JSON object"
    return obj, ""


def messages(system: str, user: str) -> Messages:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


class Drafter:
    """The drafting LLM of one build run: cached requests, one repair each, counted and priced."""

    def __init__(
        self,
        cfg: JudgeConfig,
        cache_path: str = "",
        price_in: float = 0.0,
        price_out: float = 0.0,
        client: Any = None,
    ):
        if price_in < 0 or price_out < 0:
            raise ValueError("--price-in and --price-out are dollars per 1M tokens: give numbers >= 0")
        self.cfg, self.price_in, self.price_out = cfg, price_in, price_out
        self._client = client
        self.cache = JudgeCache(cache_path)
        self.counts: Counter = Counter()

    @property
    def client(self) -> Any:
        if self._client is None:  # built on first use: a local model loads only if the cache lacks a reply
            self._client = make_client(self.cfg)
        return self._client

    def key(self, req: ChatRequest) -> str:
        c = self.cfg
        settings = [
            c.backend,
            c.model,
            c.temperature,
            c.extra_body,
            c.json_mode,
            req.max_tokens,
            req.json_schema,
        ]
        return hashlib.sha256(json.dumps(["build", settings, req.messages]).encode()).hexdigest()

    def ask(self, reqs: Sequence[ChatRequest]) -> list[Reply]:
        """One reply per request, in order: cached ones read back, the others asked concurrently."""
        keys = [self.key(r) for r in reqs]
        out: list[Reply | None] = [None] * len(reqs)
        todo = []
        for i, k in enumerate(keys):
            hit = self.cache.get(k)
            if hit is None:
                todo.append(i)
                continue
            out[i] = Reply(hit["text"], hit.get("prompt_tokens", 0), hit.get("completion_tokens", 0))
            self.counts["cached"] += 1
            self.counts["cached_prompt_tokens"] += out[i].prompt_tokens
            self.counts["cached_completion_tokens"] += out[i].completion_tokens
        fresh = {}
        for i, r in zip(todo, self.client.chat([reqs[i] for i in todo]) if todo else []):
            out[i] = r
            self.counts["requests"] += 1
            self.counts["retries"] += r.retries
            self.counts["prompt_tokens"] += r.prompt_tokens
            self.counts["completion_tokens"] += r.completion_tokens
            if r.text is None:
                self.counts["failed"] += 1
            else:
                fresh[keys[i]] = {
                    "text": r.text,
                    "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": r.completion_tokens,
                }
        self.cache.put(fresh)
        self.cache.mem.update(fresh)  # also without a cache file: a repeated request in one run is asked once
        return [r for r in out if r is not None]

    def request(self, msgs: Messages, max_tokens: int, schema: dict[str, Any] | None = None) -> ChatRequest:
        return ChatRequest(msgs, self.cfg.max_tokens or max_tokens, json_mode=True, json_schema=schema)

    def _read(self, r: Reply, read: Reader, max_tokens: int) -> tuple[Any, str]:
        value, problem = read(r.text or "")
        if problem and r.completion_tokens >= max_tokens:  # the usual cause of broken JSON: a cut reply
            problem += f" (the reply stopped at the {max_tokens}-token limit; raise --llm.max-tokens)"
        return value, problem

    def draft(
        self,
        convs: Sequence[Messages],
        readers: Sequence[Reader],
        max_tokens: int,
        schema: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    ) -> list[tuple[Any, str]]:
        """(value, '') per conversation, or (None, problem) when its reply is still bad after one repair.
        `schema`: the replies' JSON schema, one for all or one per conversation."""
        schemas = list(schema) if isinstance(schema, (list, tuple)) else [schema] * len(convs)
        reqs = [self.request(m, max_tokens, sc) for m, sc in zip(convs, schemas)]
        limit = reqs[0].max_tokens if reqs else max_tokens
        replies = self.ask(reqs)
        got = [
            self._read(r, read, limit) if r.text is not None else (None, f"no reply from the LLM ({r.error})")
            for r, read in zip(replies, readers)
        ]
        fix = [k for k, (_, problem) in enumerate(got) if problem and replies[k].text is not None]
        repairs = [
            self.request(
                [
                    *convs[k],
                    {"role": "assistant", "content": replies[k].text or ""},
                    {"role": "user", "content": REPAIR.format(problem=got[k][1])},
                ],
                max_tokens,
                schemas[k],
            )
            for k in fix
        ]
        self.counts["repairs"] += len(repairs)
        for k, r in zip(fix, self.ask(repairs)):
            if r.text is None:
                got[k] = (None, f"no reply to the repair request ({r.error})")
                continue
            value, problem = self._read(r, readers[k], limit)
            got[k] = (value, f"still wrong after one repair: {problem}" if problem else "")
        return got

    def summary(self) -> str:
        """Requests, tokens and the cost estimate of this run (and what the cache saved)."""
        c = self.counts
        cost = (c["prompt_tokens"] * self.price_in + c["completion_tokens"] * self.price_out) / 1e6
        saved = (
            c["cached_prompt_tokens"] * self.price_in + c["cached_completion_tokens"] * self.price_out
        ) / 1e6
        lines = [
            f"requests: {c['requests']} sent ({c['retries']} retries, {c['failed']} failed), {c['cached']} replies "
            f"from the cache; {c['repairs']} drafts needed a repair request",
            f"tokens: {c['prompt_tokens']:,} prompt + {c['completion_tokens']:,} completion this run; "
            f"{c['cached_prompt_tokens']:,} + {c['cached_completion_tokens']:,} read from the cache",
            f"cost estimate: ${cost:.4f} this run (${saved:.4f} more for the cached replies) at "
            f"${self.price_in:g} / ${self.price_out:g} per 1M prompt / completion tokens",
        ]
        return "\n".join(lines)


@dataclass(frozen=True)
class DraftArgs:
    """The options every LLM subcommand shares: files, the drafting LLM, prices."""

    input: tyro.conf.Positional[str]
    """Input JSONL: one row a line, each keeping its fields in the output."""
    out: str
    """Output JSONL: the rows that were made good, with the new field; train.py reads it as is."""
    llm: JudgeConfig = field(default_factory=JudgeConfig)
    """The drafting LLM (--llm.base-url, --llm.model, --llm.concurrency, --llm.max-retries, ...); --llm.cache
    is the reply cache (default: OUT with the suffix .cache.jsonl; a rerun asks only what is not in it);
    --llm.max-tokens 0 leaves each request its subcommand's default (1024 or 2048)."""
    price_in: Annotated[float, at_least(0, "dollars per 1M tokens")] = 0.0
    """Dollars per 1M prompt tokens, for the cost estimate."""
    price_out: Annotated[float, at_least(0, "dollars per 1M tokens")] = 0.0
    """Dollars per 1M completion tokens, for the cost estimate."""
    limit: Annotated[int, at_least(0, "0 = all")] = 0
    """Only the first N rows (0 = all)."""
    chunk: Annotated[int, at_least(0, "0 = 4 x --llm.concurrency")] = 0
    """Rows whose requests go out together (0 = 4 x --llm.concurrency); the progress bar moves by chunks."""


def drafter_for(args: DraftArgs, client: Any = None) -> tuple[Drafter, io.Rejects, Path]:
    """The run's Drafter (its cache next to --out unless --llm.cache names one), its rejects and their file.

    The LLM server is checked first (one GET of /models) unless a client is handed in, so a server that
    is down stops the build at once, not after a file of failed rows."""
    rejected, default_cache = io.out_paths(args.out, args.input)
    if not args.llm.model:
        raise ValueError("name the drafting LLM: --llm.model (the model name its server serves)")
    if client is None:
        check_endpoint(args.llm, flag="--llm")
    d = Drafter(args.llm, args.llm.cache or str(default_cache), args.price_in, args.price_out, client)
    return d, io.Rejects(args.input, []), rejected


@dataclass
class Drafted:
    """What a drafting subcommand did: the rows it read, the rows it wrote, those it left out, its drafter."""

    rows: list[dict]
    written: list[dict]
    rejects: io.Rejects
    rejected_path: Path
    drafter: Drafter

    def report(self, name: str, out: str, extra: str = "") -> dict[str, Any]:
        """Print the summary (rows written and left out, then tokens and cost); the counts, as run() returns."""
        n_out = len(self.rejects.items)
        left = f", {n_out} left out (listed above and in {self.rejected_path})" if n_out else ""
        print(f"{name}: {len(self.written)} of {len(self.rows)} rows written to {out}{left}{extra}")
        print(self.drafter.summary())
        return {"written": len(self.written), "rejected": n_out, "counts": dict(self.drafter.counts)}


def draft_file(
    args: DraftArgs,
    client: Any,
    desc: str,
    draft_part: Callable[[list[dict], Drafter, io.Rejects], list[dict]],
) -> Drafted:
    """Read --input, draft it a chunk at a time (`draft_part(rows, drafter, rejects)` returns the rows to
    write), then write --out and the rejected rows."""
    rows = io.load(args.input, args.limit)
    d, rejects, rejected_path = drafter_for(args, client)
    written: list[dict] = []
    for part in io.chunks(rows, chunk_size(args), desc):
        written += draft_part(part, d, rejects)
    io.write_jsonl(args.out, written)
    rejects.report(rejected_path)
    return Drafted(rows, written, rejects, rejected_path, d)


def chunk_size(args: DraftArgs) -> int:
    return args.chunk or 4 * max(1, args.llm.concurrency)
