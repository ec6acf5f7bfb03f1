"""The judges' local backend: a model folder run in-process, greedy decoding.

rewards imports nothing of the trainer, so the model comes from a `LocalBackend` handed in: a
resolver of model names, a loader and a sampler. nanogrpo registers its own (nanogrpo.model.transformer,
nanogrpo.model.sampling, nanogrpo.model.zoo's names 'tiny' and 'smollm2') with `set_backend` before it
builds rewards; another program registers its own, or passes one to `LocalClient`.

Two ways to answer a request:
- free replies (the generative rubric readout, any request without a shape) are greedy decoding with
  the backend's `generate`; log-probs, when asked for, come from one extra forward pass over
  prompt + reply (the sampler keeps only the chosen token's log-prob), top-k of the full softmax;
- replies of fixed shape (the judges' JSON: a request carries its `shape`, literal text and slots)
  are filled slot by slot over one KV cache: literal text is fed as is, a mark slot takes the most
  likely of its allowed marks and records the probabilities of all of them, a text slot decodes
  greedily until a quote or a new line. This is constrained decoding by construction: even a small
  model writes valid marks, and judge_entropy reads the mark distribution from the logits.

Where this departs from a server: literals are tokenised on their own (a server would tokenise the
reply as one text), and a mark is one token, a digit with or without a leading space.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewards.llm_client import ChatRequest, Reply, Slot, TokenLogprob
from rewards.options import JudgeConfig
from rewards.text import well_formed


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text a chat model expects (its chat template, or plain 'role: content' lines)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _logaddexp(a: float, b: float) -> float:
    hi, lo = max(a, b), min(a, b)
    return hi + math.log1p(math.exp(lo - hi))


@dataclass(frozen=True)
class LocalBackend:
    """What the local judge needs from the program that runs it.

    resolve(name) -> an HF model folder (config.json, *.safetensors, tokenizer) for a model name or path.
    load(folder, dtype, device) -> the model: `model(ids)` gives logits (B, T, V) for ids (B, T),
      `model(ids, kv_cache=cache)` the same over a cache from `model.new_kv_cache(batch, max_len)`;
      `model.config.eos_token_ids` (an id or a list) and `model.lm_head_weight` (for its device).
    generate(model, prompts, max_new_tokens, temperature, eos_ids, pad_id) -> an object with
      `completion_ids` (B, T) and `mask` (B, T), 1 on the generated tokens.
    """

    resolve: Callable[[str], Path]
    load: Callable[[Path, Any, str], Any]
    generate: Callable[..., Any]


_backend: LocalBackend | None = None


def set_backend(backend: LocalBackend | None) -> None:
    """Register the backend that local judges (and probes, for model names) use; None unregisters."""
    global _backend
    _backend = backend


def get_backend() -> LocalBackend:
    if _backend is None:
        raise ValueError(
            "the local judge has no model backend: run it through nanogrpo (train.py, eval.py), or register "
            "one with rewards.local_client.set_backend(LocalBackend(resolve, load, generate))"
        )
    return _backend


def resolve_model(name: str) -> Path:
    """A model name or path -> its folder, through the registered backend; without one, a folder only."""
    if _backend is not None:
        return _backend.resolve(name)
    if not Path(name).expanduser().is_dir():
        raise ValueError(
            f"model {name!r} is not a folder, and no backend is registered to resolve model names "
            "(nanogrpo's: `python -m nanogrpo.model.zoo NAME` prints the folder of 'tiny' or 'smollm2')"
        )
    return Path(name).expanduser()


class LocalClient:
    """A model folder ('smollm2', 'tiny' or a path) answering chat requests in-process."""

    def __init__(self, cfg: JudgeConfig, backend: LocalBackend | None = None):
        import torch
        from transformers import AutoTokenizer

        if not cfg.model:
            raise ValueError(
                "the local judge needs a model folder: set --reward.judge.model (a path, 'smollm2' or 'tiny')"
            )
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if cfg.dtype not in dtypes:
            raise ValueError(f"--reward.judge.dtype must be one of {sorted(dtypes)}, got {cfg.dtype!r}")
        self.backend = backend or get_backend()
        path = self.backend.resolve(cfg.model)
        self.cfg = cfg
        self.model = self.backend.load(path, dtypes[cfg.dtype], cfg.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        eos = self.model.config.eos_token_ids
        self.eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._mark_ids: dict[int, list[int]] | None = None

    @property
    def device(self) -> Any:
        return self.model.lm_head_weight.device

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        text = well_formed(render_chat(self.tokenizer, messages))  # a lone surrogate made the tokenizer raise
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat(self, reqs: list[ChatRequest]) -> list[Reply]:
        # one at a time: judge prompts differ a lot in length, and padding would cost more than it saves
        return [self.fill(r) if r.shape else self.generate(r) for r in reqs]

    # -- free replies ------------------------------------------------------------------------
    def generate(self, req: ChatRequest) -> Reply:
        import torch

        ids = self.encode(req.messages)
        with torch.no_grad():
            gen = self.backend.generate(self.model, [ids], max_new_tokens=req.max_tokens, temperature=0.0,
                                        eos_ids=self.eos_ids, pad_id=self.pad_id)  # fmt: skip
        n = int(gen.mask[0].sum())
        reply_ids = gen.completion_ids[0, :n].tolist()
        tokens = self.token_logprobs(ids, reply_ids, req.top_logprobs) if req.top_logprobs > 0 else None
        text = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
        return Reply(text=text, prompt_tokens=len(ids), completion_tokens=n, tokens=tokens)

    def token_logprobs(self, prompt_ids: list[int], reply_ids: list[int], k: int) -> list[TokenLogprob]:
        """Log-probs of each reply token and of the top-k alternatives, from one forward pass."""
        import torch

        if not reply_ids:
            return []
        x = torch.tensor([prompt_ids + reply_ids], device=self.device)  # (1, T)
        with torch.no_grad():
            logits = self.model(x)[0, len(prompt_ids) - 1 : -1].float()  # (n, V): position t predicts t+1
        logp = torch.log_softmax(logits, dim=-1)  # (n, V)
        top_lp, top_id = logp.topk(min(k, logp.shape[-1]), dim=-1)  # (n, k)
        out = []
        for i, tok in enumerate(reply_ids):
            top: dict[str, float] = {}
            for lp, j in zip(top_lp[i].tolist(), top_id[i].tolist()):
                text = self.tokenizer.decode([j])
                top[text] = _logaddexp(top[text], lp) if text in top else lp  # same text: add the mass
            out.append(TokenLogprob(self.tokenizer.decode([tok]), float(logp[i, tok]), top))
        return out

    # -- replies of fixed shape --------------------------------------------------------------
    @property
    def mark_ids(self) -> dict[int, list[int]]:
        """Digit -> the token ids that write it ('4' and ' 4')."""
        if self._mark_ids is None:
            self._mark_ids = {d: [] for d in range(10)}
            for i in range(len(self.tokenizer)):
                m = re.fullmatch(r" ?([0-9])", self.tokenizer.decode([i]))
                if m:
                    self._mark_ids[int(m.group(1))].append(i)
        return self._mark_ids

    def fill(self, req: ChatRequest) -> Reply:
        """Write the request's shape: literals as given, each slot filled greedily (see the docstring)."""
        import torch

        assert req.shape is not None
        prompt = self.encode(req.messages)
        lits = {
            p: self.tokenizer(p, add_special_tokens=False)["input_ids"]
            for p in req.shape
            if isinstance(p, str)
        }
        budget = len(prompt) + sum(
            len(lits[p]) if isinstance(p, str) else max(1, p.max_tokens) for p in req.shape
        )
        cache = self.model.new_kv_cache(1, budget)

        def feed(ids: list[int]) -> torch.Tensor:
            with torch.no_grad():
                x = torch.tensor([ids], device=self.device)  # (1, t)
                return torch.log_softmax(self.model(x, kv_cache=cache)[0, -1].float(), -1)  # (V,)

        logp, text, tokens, n_new = feed(prompt), "", [], 0
        for part in req.shape:
            if isinstance(part, str):
                piece = part
                tokens.append(TokenLogprob(piece, 0.0, {piece: 0.0}))
                if lits[part]:
                    logp = feed(lits[part])
                    n_new += len(lits[part])
            elif part.marks:
                piece, tok = self._mark(logp, part, tokens)
                logp = feed([tok])
                n_new += 1
            else:
                piece, logp, n = self._text(logp, part, feed)
                tokens.append(TokenLogprob(piece, 0.0, {piece: 0.0}))
                n_new += n
            text += piece
        tokens_out = tokens if req.top_logprobs > 0 else None
        return Reply(text=text, prompt_tokens=len(prompt), completion_tokens=n_new, tokens=tokens_out)

    def _mark(self, logp: Any, slot: Slot, tokens: list[TokenLogprob]) -> tuple[str, int]:
        """The most likely allowed mark; its token and the allowed alternatives go into `tokens`."""
        ids = self.mark_ids
        mass = {d: float(logp[ids[d]].logsumexp(0)) if ids[d] else -math.inf for d in slot.marks}
        best = max(slot.marks, key=lambda d: mass[d])
        assert ids[best], f"the judge's tokenizer has no token for the mark {best}"
        tok = max(ids[best], key=lambda i: float(logp[i]))
        top: dict[str, float] = {}
        for d in slot.marks:
            for i in ids[d]:
                t = self.tokenizer.decode([i])
                top[t] = _logaddexp(top[t], float(logp[i])) if t in top else float(logp[i])
        piece = self.tokenizer.decode([tok])
        tokens.append(TokenLogprob(piece, float(logp[tok]), top))
        return piece, tok

    def _text(self, logp: Any, slot: Slot, feed: Any) -> tuple[str, Any, int]:
        """Greedy free text until a quote, a new line, EOS or max_tokens: (JSON-escaped text, logp, tokens)."""
        out, n = "", 0
        for _ in range(slot.max_tokens):
            tok = int(logp.argmax())
            piece = self.tokenizer.decode([tok])
            if tok in self.eos_ids or '"' in piece or "\n" in piece:
                break  # not fed: the shape's next literal closes the string
            out += piece
            logp = feed([tok])
            n += 1
        return json.dumps(out.strip(), ensure_ascii=False)[1:-1], logp, n
