"""Chat clients for the judges: an OpenAI-compatible HTTP client and an in-process local model.

Both take a list of `ChatRequest`s and return one `Reply` per request, in order, and never raise on
a bad or missing reply: a call that fails after its retries comes back as `Reply(text=None, error=...)`
and the judge turns it into None scores. Configuration mistakes that no retry can fix (401, 403,
404: a wrong key, URL or model name) raise `JudgeServerError` at once, a ValueError whose one line
says what to fix (train.py and eval.py print it and exit 2).

The local backend (an in-process model) is in rewards/local_client.py. The HTTP client is asyncio
over the standard library's http.client (one worker thread per request in flight), so nanogrpo needs
no HTTP package: a semaphore bounds the requests in flight; each try has a deadline,
--reward.judge.timeout-s, for all of it (connect, send, the whole response: a server that drips a
byte a second is cut off there); timeouts, connection errors, 408, 429 and 5xx are retried with
exponential backoff, honouring a Retry-After header. Redirects are never followed: the API key is
read from the environment variable named by `JudgeConfig.api_key_env` at request time and sent, in
the Authorization header only, to --reward.judge.base-url and nowhere else; it is scrubbed from
every error message: never logged, never stored in a sample and never in a saved config. A server
that echoes it (or any key-shaped string: sk-..., Bearer ..., see `redact`) in a reply has it replaced
by '[redacted]' before the reply reaches a judge, the reward-data builder or a cache. Proxies named by
http_proxy / https_proxy (and no_proxy) are used as urllib would.

A reply that is not a chat completion, or whose content is not text, is an error of that try (it is
retried); `usage` of the wrong shape counts 0 tokens. What the judges cannot read in a good reply
scores None there (rewards/judge.py). docs/JUDGES.md has the table of faults and what each does.

`check_endpoint` runs at start-up (RewardFunction.validate, eval.py): one GET of the server's /models
with a short timeout, so a run whose judge server is down stops before the policy loads, with the
URL and the flag to fix, instead of scoring every answer None for hours.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.utils
import http.client
import json
import logging
import math
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

from rewards.options import JudgeConfig
from rewards.transport import http_request

log = logging.getLogger(__name__)

JSON_MODES = ("object", "schema", "object-schema", "off")


CHECK_TIMEOUT_S = 10.0
"""Longest wait for the start-up check's answer (a server that is up answers GET /models at once)."""

_ANSWERED: set[str] = set()  # base URLs that answered the check: asked once per process, not per call


class JudgeServerError(ValueError):
    """The judge server refused the request in a way no retry can fix (wrong URL, model or key).

    A ValueError, like every mistake of configuration: train.py and eval.py print its one line, exit 2."""


REDACTED = "[redacted]"
MIN_KEY_CHARS = 8
"""A configured key shorter than this (a placeholder such as 'EMPTY' for a local server) is not looked
for in replies: replacing it would garble them and it guards nothing."""
# Common shapes of API keys and tokens (OpenAI/Anthropic 'sk-', Hugging Face, GitHub, Google, AWS,
# Groq, xAI, an HTTP bearer token), each a literal prefix and one run of key characters: linear time.
_KEY_SHAPES = re.compile(
    r"\b(?:sk|rk|pk)-[\w-]{20,}"
    r"|\bhf_[A-Za-z0-9]{20,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_\w{20,}"
    r"|\bAIza[\w-]{30,}|\bAKIA[0-9A-Z]{16}\b"
    r"|\bgsk_\w{20,}|\bxai-[\w-]{20,}"
    r"|\b[Bb]earer\s+[\w.~+/=-]{20,}"
)


def api_key(cfg: JudgeConfig) -> str:
    """The API key of `cfg`, read from its environment variable now ('' when unset)."""
    return os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""


def redact(text: str, key: str = "") -> str:
    """`text` with the API key `key` (MIN_KEY_CHARS or longer) and every key-shaped string replaced by
    '[redacted]': what a judge server writes is stored (reasons in samples.jsonl, the run page, the
    caches), and a server may echo the key it was sent."""
    if key and len(key) >= MIN_KEY_CHARS and key in text:
        text = text.replace(key, REDACTED)
    return _KEY_SHAPES.sub(REDACTED, text)


def _one_line(text: str, n: int = 300) -> str:
    return " ".join(text.split())[:n]


@dataclass
class ChatRequest:
    messages: list[dict[str, str]]
    max_tokens: int
    json_mode: bool = False
    top_logprobs: int = 0
    """> 0 asks for the log-probs of each generated token and of this many alternatives."""
    json_schema: dict[str, Any] | None = None
    """The reply's JSON schema, sent when --reward.judge.json-mode asks for a schema."""
    shape: list[str | Slot] | None = None
    """The reply's fixed shape, literal text and slots: a local model fills only the slots."""


@dataclass(frozen=True)
class Slot:
    """A hole in a reply of fixed shape: one mark from `marks`, or free text of up to `max_tokens`."""

    marks: tuple[int, ...] = ()
    max_tokens: int = 0


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: dict[str, float] = field(default_factory=dict)
    """Alternative token text -> log-prob at this position (the generated token included)."""


@dataclass
class Reply:
    text: str | None
    """The reply's content; None when the call failed after its retries."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens: list[TokenLogprob] | None = None
    """Per generated token log-probs, when asked for and returned."""
    error: str = ""
    retries: int = 0


def run_sync(coro: Any) -> Any:
    """Run a coroutine to completion, also from code already inside an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _retry_after(headers: dict[str, str]) -> float | None:
    """Seconds asked for by a Retry-After header (delta-seconds or an HTTP date), if any."""
    value = {k.lower(): v for k, v in headers.items()}.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _location(headers: dict[str, str]) -> str:
    return {k.lower(): v for k, v in headers.items()}.get("location", "")


def _portable(schema: Any) -> Any:
    """The schema without length and count limits, which strict json_schema modes (OpenAI) refuse."""
    if isinstance(schema, dict):
        drop = {"minLength", "maxLength", "minItems", "maxItems"}
        return {k: _portable(v) for k, v in schema.items() if k not in drop}
    return [_portable(v) for v in schema] if isinstance(schema, list) else schema


def _logprob(v: Any) -> float:
    """A log-prob as sent, or NaN when it is not one (not a number, NaN, +inf, or well above 0)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v > 1e-4:
        return math.nan
    return min(float(v), 0.0)  # -inf is a probability of 0; a hair above 0 is rounding


def parse_logprobs(choice: dict[str, Any]) -> list[TokenLogprob] | None:
    """The chat-completions `logprobs.content` list as TokenLogprobs (None if the server sent none).

    Nothing here raises on a hostile reply: a token whose log-prob or alternatives cannot be read
    gets logprob NaN and no alternatives, and the readers (judge_entropy, the rubric's logprob
    readout) score the answer that needed it None; a token that is not text becomes ''.
    """
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else lp
    if content is None:
        return None
    out = []
    for item in content if isinstance(content, list) else []:
        item = item if isinstance(item, dict) else {}
        token, logprob = item.get("token"), _logprob(item.get("logprob"))
        top: dict[str, float] = {}
        alts = item.get("top_logprobs", [])
        for t in alts if isinstance(alts, list) else [None]:
            t_tok, t_lp = (
                (t.get("token"), _logprob(t.get("logprob"))) if isinstance(t, dict) else (None, math.nan)
            )
            if not isinstance(t_tok, str) or t_lp != t_lp:
                top, logprob = {}, math.nan  # one unreadable alternative: the position cannot be read
                break
            top[t_tok] = t_lp
        out.append(TokenLogprob(token if isinstance(token, str) else "", logprob, top))
    return out


def _count(v: Any) -> int:
    """A token count from `usage`, 0 when it is not a finite non-negative number."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return int(v) if ok else 0


def read_chat(body: bytes) -> tuple[str, int, int, list[TokenLogprob] | None]:
    """(text, prompt tokens, completion tokens, log-probs) of a chat-completions response body.

    ValueError when the body is not one: not JSON, no choices, a message or content that is not
    what the API says. `usage` of the wrong shape counts 0 tokens: the reply itself is still good.
    """
    try:
        data = json.loads(body)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("no 'choices' list with a choice object")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise ValueError("the choice has no 'message' object")
    text = message.get("content")
    if text is None:
        text = ""  # said nothing (a refusal, a reasoning model out of tokens): unparsable, repaired
    if not isinstance(text, str):
        raise ValueError(f"the message's content is a {type(text).__name__}, not a string")
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    tokens = parse_logprobs(choices[0])
    return text, _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), tokens


class OpenAIClient:
    """Any OpenAI-compatible chat-completions server: vLLM, SGLang, llama.cpp server, a hosted API."""

    def __init__(self, cfg: JudgeConfig):
        if not cfg.model:
            raise ValueError(
                "the judge needs a model name: set --reward.judge.model (the name the server serves)"
            )
        if cfg.json_mode not in JSON_MODES:
            raise ValueError(
                f"--reward.judge.json-mode must be one of {', '.join(JSON_MODES)}, got {cfg.json_mode!r}"
            )
        try:
            self.extra = json.loads(cfg.extra_body) if cfg.extra_body else {}
        except ValueError as e:
            raise ValueError(
                f"--reward.judge.extra-body is not JSON ({e}): give an object, e.g. '{{\"seed\": 0}}'"
            ) from None
        if not isinstance(self.extra, dict):
            raise ValueError(
                "--reward.judge.extra-body must be a JSON object, e.g. '{\"repeat_penalty\": 1.0}'"
            )
        if cfg.max_tokens < 0:
            raise ValueError(
                f"--reward.judge.max-tokens must be >= 0 (0 = the judge's default), got {cfg.max_tokens}"
            )
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"

    def _key(self) -> str:
        return api_key(self.cfg)

    def _scrub(self, text: str) -> str:
        key = self._key()
        return text.replace(key, "***") if key else text

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if (key := self._key()) else {}

    def _post(self, payload: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": "application/json"} | self._headers()
        return http_request("POST", self.url, json.dumps(payload).encode(), headers, self.cfg.timeout_s)

    def check(self, flag: str = "--reward.judge") -> None:
        """One GET of {base_url}/models: ValueError with the fix when nothing answers or the key is refused.

        Any other HTTP answer (a server without /models: 404, 405, 501) counts as up: something speaks
        HTTP there, and a wrong path or model name stops the run at its first request (JudgeServerError).
        `flag` is the prefix of the flags to name: '--reward.judge' (train.py) or '--server' (eval.py elo).
        """
        base = self.cfg.base_url.rstrip("/")
        if base in _ANSWERED:
            return
        try:
            status, headers, _ = http_request(
                "GET", base + "/models", None, self._headers(), min(CHECK_TIMEOUT_S, self.cfg.timeout_s)
            )
        except (OSError, http.client.HTTPException, ValueError) as e:  # refused, timed out, not HTTP, bad URL
            why = self._scrub(f"{type(e).__name__}: {getattr(e, 'reason', e)}")
            raise ValueError(
                f"no OpenAI-compatible server answered at {base} ({why}): start the judge server, "
                f"or fix {flag}.base-url"
            ) from None
        if status in (401, 403):
            raise ValueError(
                f"the judge server at {base} refused the API key (HTTP {status}): put a valid key in "
                f"${self.cfg.api_key_env}, or name the right variable with {flag}.api-key-env"
            )
        if 300 <= status < 400:
            where = _location(headers)
            hint = where.removesuffix("/models") if where.endswith("/models") else where
            raise ValueError(
                self._scrub(
                    f"the judge server at {base} redirects to {where or '(no Location)'} (HTTP {status}); "
                    f"redirects are not followed (the API key goes only where you send it): set "
                    f"{flag}.base-url to {hint or 'the URL the server lives at'}"
                )
            )
        _ANSWERED.add(base)

    def _payload(self, req: ChatRequest) -> dict[str, Any]:
        assert req.max_tokens > 0, f"a chat request needs max_tokens >= 1 (servers refuse {req.max_tokens})"
        p: dict[str, Any] = {
            "model": self.cfg.model,
            "messages": req.messages,
            "max_tokens": req.max_tokens,
            "temperature": self.cfg.temperature,
        }
        mode = self.cfg.json_mode
        if req.json_mode and mode != "off":
            if mode == "schema" and req.json_schema:
                p["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "judgement",
                        "schema": _portable(req.json_schema),
                        "strict": True,
                    },
                }
            elif mode == "object-schema" and req.json_schema:
                p["response_format"] = {"type": "json_object", "schema": req.json_schema}
            else:
                p["response_format"] = {"type": "json_object"}
        if req.top_logprobs > 0:
            p["logprobs"] = True
            p["top_logprobs"] = req.top_logprobs
        return p | self.extra

    async def _one(self, req: ChatRequest, sem: asyncio.Semaphore) -> Reply:
        cfg, payload, error = self.cfg, self._payload(req), ""
        async with sem:  # held through backoff sleeps too: a rate-limited server gets fewer requests
            for attempt in range(cfg.max_retries + 1):
                wait = None
                try:
                    status, headers, body = await asyncio.to_thread(self._post, payload)
                except (OSError, http.client.HTTPException, ValueError) as e:  # timeouts, dropped, too big
                    error = f"{type(e).__name__}: {e}"
                else:
                    if status == 200:
                        try:
                            text, p_tok, c_tok, tokens = read_chat(body)
                            return Reply(redact(text, self._key()), p_tok, c_tok, tokens, retries=attempt)
                        except ValueError as e:  # the body is not a chat completion
                            error = f"malformed response body ({e})"
                    elif 300 <= status < 400:
                        where = _location(headers) or "(no Location)"
                        error = (
                            f"HTTP {status} redirect to {where}, not followed: fix --reward.judge.base-url"
                        )
                        break  # not retried: the server will send us there again
                    else:
                        error = f"HTTP {status}: {_one_line(body[:2000].decode('utf-8', 'replace'))}"
                        if status in (401, 403, 404):
                            raise JudgeServerError(
                                self._scrub(
                                    f"judge server {self.url} answered {error}. Check --reward.judge.base-url, "
                                    f"--reward.judge.model and the key in ${cfg.api_key_env}."
                                )
                            )
                        if status not in (408, 409, 429) and status < 500:
                            break  # a request the server will never accept: do not retry it
                        wait = _retry_after(headers)
                if attempt == cfg.max_retries:
                    break
                if wait is None:  # exponential backoff with a little jitter so clients do not stampede
                    wait = cfg.backoff_s * 2**attempt * (1 + 0.1 * random.random())
                await asyncio.sleep(min(wait, cfg.max_backoff_s))
        error = self._scrub(error)
        log.warning("judge request to %s failed after %d tries: %s", self.url, attempt + 1, error)
        return Reply(text=None, error=error, retries=attempt)

    async def _gather(self, reqs: list[ChatRequest]) -> list[Reply]:
        sem = asyncio.Semaphore(max(1, self.cfg.concurrency))
        return await asyncio.gather(*(self._one(r, sem) for r in reqs))

    def chat(self, reqs: list[ChatRequest]) -> list[Reply]:
        return run_sync(self._gather(reqs)) if reqs else []


def check_endpoint(cfg: JudgeConfig, flag: str = "--reward.judge") -> None:
    """At start-up: the judge server of `cfg` answers (OpenAIClient.check); a local backend needs no
    server, only a model backend registered (rewards.local_client.set_backend; nanogrpo registers one)."""
    if cfg.backend == "openai":
        OpenAIClient(cfg).check(flag)
    elif cfg.backend == "local":
        from rewards.local_client import get_backend

        get_backend()
    else:
        raise ValueError(f"{flag}.backend must be 'openai' or 'local', got {cfg.backend!r}")


def make_client(cfg: JudgeConfig) -> Any:
    """The client of --reward.judge.backend: an OpenAIClient, or a LocalClient (rewards/local_client.py)."""
    if cfg.backend == "openai":
        return OpenAIClient(cfg)
    if cfg.backend == "local":
        from rewards.local_client import LocalClient

        return LocalClient(cfg)
    raise ValueError(f"--reward.judge.backend must be 'openai' or 'local', got {cfg.backend!r}")
