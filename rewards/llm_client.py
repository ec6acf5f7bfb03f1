"""Chat clients for the judges: an OpenAI-compatible HTTP client and an in-process local model.

Both take a list of `ChatRequest`s and return one `Reply` per request, in order, and never raise on
a bad or missing reply: a call that fails after its retries comes back as `Reply(text=None, error=...)`
and the judge turns it into None scores. Configuration mistakes that no retry can fix (401, 403,
404: a wrong key, URL or model name) raise `JudgeServerError` at once, with the fix in the message.

The local backend (an in-process model) is in rewards/local_client.py. The HTTP client is asyncio over the standard library's urllib (one worker thread per request in
flight), so nanogrpo needs no HTTP package: a semaphore bounds the requests in flight, each try has
a timeout, and timeouts, connection errors, 408, 429 and 5xx are retried with exponential backoff,
honouring a Retry-After header. The API key is read from the environment variable named by
`JudgeConfig.api_key_env` at request time, sent only in the Authorization header, and scrubbed from
every error message: it is never logged, never stored in a sample and never in a saved config.

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
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from rewards.options import JudgeConfig

log = logging.getLogger(__name__)

JSON_MODES = ("object", "schema", "object-schema", "off")


CHECK_TIMEOUT_S = 10.0
"""Longest wait for the start-up check's answer (a server that is up answers GET /models at once)."""

_ANSWERED: set[str] = set()  # base URLs that answered the check: asked once per process, not per call


class JudgeServerError(RuntimeError):
    """The judge server refused the request in a way no retry can fix (wrong URL, model or key)."""


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
    except (TypeError, ValueError):
        return None


def _portable(schema: Any) -> Any:
    """The schema without length and count limits, which strict json_schema modes (OpenAI) refuse."""
    if isinstance(schema, dict):
        drop = {"minLength", "maxLength", "minItems", "maxItems"}
        return {k: _portable(v) for k, v in schema.items() if k not in drop}
    return [_portable(v) for v in schema] if isinstance(schema, list) else schema


def parse_logprobs(choice: dict[str, Any]) -> list[TokenLogprob] | None:
    """The chat-completions `logprobs.content` list as TokenLogprobs (None if the server sent none)."""
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list):
        return None
    out = []
    for item in content:
        top = {t["token"]: float(t["logprob"]) for t in item.get("top_logprobs") or [] if "token" in t}
        out.append(TokenLogprob(item.get("token", ""), float(item.get("logprob", -math.inf)), top))
    return out


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
        return os.environ.get(self.cfg.api_key_env, "") if self.cfg.api_key_env else ""

    def _scrub(self, text: str) -> str:
        key = self._key()
        return text.replace(key, "***") if key else text

    def _post(self, payload: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": "application/json"}
        if key := self._key():
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url, json.dumps(payload).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers or {}), e.read()

    def check(self, flag: str = "--reward.judge") -> None:
        """One GET of {base_url}/models: ValueError with the fix when nothing answers or the key is refused.

        Any other HTTP answer (a server without /models: 404, 405, 501) counts as up: something speaks
        HTTP there, and a wrong path or model name stops the run at its first request (JudgeServerError).
        `flag` is the prefix of the flags to name: '--reward.judge' (train.py) or '--server' (eval.py elo).
        """
        base = self.cfg.base_url.rstrip("/")
        if base in _ANSWERED:
            return
        headers = {"Authorization": f"Bearer {key}"} if (key := self._key()) else {}
        req = urllib.request.Request(base + "/models", headers=headers, method="GET")
        try:
            with urllib.request.urlopen(req, timeout=min(CHECK_TIMEOUT_S, self.cfg.timeout_s)) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise ValueError(
                    f"the judge server at {base} refused the API key (HTTP {e.code}): put a valid key in "
                    f"${self.cfg.api_key_env}, or name the right variable with {flag}.api-key-env"
                ) from None
        except (OSError, http.client.HTTPException, ValueError) as e:  # refused, timed out, not HTTP, bad URL
            why = self._scrub(f"{type(e).__name__}: {getattr(e, 'reason', e)}")
            raise ValueError(
                f"no OpenAI-compatible server answered at {base} ({why}): start the judge server, "
                f"or fix {flag}.base-url"
            ) from None
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
                except (OSError, http.client.HTTPException) as e:  # timeouts, refused or dropped connections
                    error = f"{type(e).__name__}: {e}"
                else:
                    if status == 200:
                        try:
                            data = json.loads(body)
                            choice = data["choices"][0]
                            usage = data.get("usage") or {}
                            return Reply(
                                text=choice["message"].get("content") or "",
                                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                                completion_tokens=int(usage.get("completion_tokens") or 0),
                                tokens=parse_logprobs(choice),
                                retries=attempt,
                            )
                        except (ValueError, KeyError, IndexError, TypeError) as e:
                            error = f"malformed response body ({type(e).__name__}: {e})"
                    else:
                        error = f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}"
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
    """At start-up: the judge server of `cfg` answers (OpenAIClient.check); a local backend needs none."""
    if cfg.backend == "openai":
        OpenAIClient(cfg).check(flag)
    elif cfg.backend != "local":
        raise ValueError(f"{flag}.backend must be 'openai' or 'local', got {cfg.backend!r}")


def make_client(cfg: JudgeConfig) -> Any:
    """The client of --reward.judge.backend: an OpenAIClient, or a LocalClient (rewards/local_client.py)."""
    if cfg.backend == "openai":
        return OpenAIClient(cfg)
    if cfg.backend == "local":
        from rewards.local_client import LocalClient

        return LocalClient(cfg)
    raise ValueError(f"--reward.judge.backend must be 'openai' or 'local', got {cfg.backend!r}")
