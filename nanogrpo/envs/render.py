"""How an observation joins a trajectory: token ids appended after an assistant turn, as the chat template
would render the next message, so the sampler and the trainer read the conversation a chat model expects.

A trajectory is never re-rendered from its messages: the sampled ids stay exactly as sampled, and each
observation appends the template's suffix (the assistant turn's closing, the message, the next assistant
header). That is only right for a template that keeps earlier turns as they were, which `TurnFormat.of`
checks at start-up on a made-up conversation; a template that rewrites them is refused with the way out
(--env.format plain), and a tokenizer without a template gets plain 'role: text' lines.

One rewrite is accepted on purpose: a thinking template (Qwen3's) that drops the <think> blocks of earlier
assistant turns. The made-up conversation holds a <think> block to find it; the history then keeps the
sampled thinking (what the model wrote is what it reads next and what is trained), and the run says so at
start-up: a deployment that re-renders the history through the template shows the model a context without
its earlier thinking, which it was not trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_A, _B, _C, _D, _E = "PROMPT-7f3a", "REPLY-1c9e", "OBSERVATION-5d2b", "REPLY-8e4f", "OBSERVATION-2a6c"
_THINK = "<think>\nTHOUGHT-6e1b\n</think>\n\n"  # a thinking turn's block, as Qwen3's template writes one
_Q = ' QUOTED-3f8a "x"\n\\ '  # an observation with what templates trim or escape
_NO_THINK = "<think>\n\n</think>\n\n"  # the empty block a non-thinking template writes before a reply
WAYS = ("", "trim", "json", "trim json")
"""How a template writes a message's text: as it is, trimmed (Llama 3's user messages), as the inside of a JSON
string (Llama 3's tool messages: `content | tojson`), or both."""


def written(text: str, way: str) -> str:
    """`text` as a template writes it the way `way` (one of WAYS)."""
    if "trim" in way:
        text = text.strip()
    return json.dumps(text, ensure_ascii=False)[1:-1] if "json" in way else text


@dataclass(frozen=True)
class TurnFormat:
    """The text around an observation: `close` ends the assistant turn (its EOS excepted when the turn ended
    on EOS), `open` starts the observation message, `after` closes it and opens the next assistant turn."""

    close: str
    open: str
    after: str
    eos_text: str  # the EOS token's text, which a turn that ended on EOS already holds
    specials: tuple[str, ...] = ()  # the control tokens' texts, which stay text inside an observation
    thinking: str = ""  # what the template does to earlier turns' <think> blocks: '' (keeps them), 'drops'
    way: str = ""  # how the template writes the observation's text (WAYS): '' as it is
    opening: str = ""  # the start of a reply the prompt already holds (Qwen3.5's '<think>\n'), in its message

    @classmethod
    def of(
        cls, tokenizer, role: str, fmt: str = "auto", system: str = "", tools: list[dict] | None = None
    ) -> TurnFormat:
        """The format for `role` ('user' or 'tool'): the chat template's (checked, rendered with `tools`
        as the first message is) or plain lines."""
        eos = tokenizer.eos_token or ""
        specials = special_texts(tokenizer)
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if fmt == "plain" or (fmt == "auto" and not has_template):
            return cls(close="", open=f"\n{role}: ", after="\nassistant: ", eos_text=eos, specials=specials)
        if not has_template:
            raise ValueError("--env.format chat: the tokenizer has no chat template; use --env.format plain")
        sys_msg = [{"role": "system", "content": system}] if system else []

        def render(*texts: str) -> str:  # user, assistant, role, assistant, ...: a header ends an odd count
            roles = ["user"] + ["assistant" if i % 2 else role for i in range(1, len(texts))]
            msgs = sys_msg + [{"role": r, "content": t} for r, t in zip(roles, texts)]
            try:
                return tokenizer.apply_chat_template(
                    msgs, tools=tools or None, tokenize=False, add_generation_prompt=len(texts) % 2 == 1
                )
            except Exception as e:  # the template's own refusal (Gemma's: roles must alternate)
                raise ValueError(
                    f"the chat template cannot write a {role!r} message after an assistant turn ({e}); use "
                    "--env.format plain"
                ) from e

        refuse = (
            f"the chat template does not keep earlier turns as they were when a {role!r} message follows "
            "(it rewrites or drops them), so a trajectory's tokens would not be what the model later reads; "
            "use --env.format plain"
        )
        # a prompt that opens the reply's <think> block (Qwen3.5's thinking templates): the model samples the
        # rest of it, so the made-up replies think, and what is sampled is a reply less that opening; or one
        # that writes an empty block (Qwen3.5's non-thinking ones): the model does not think
        first = render(_A)
        opening = next((_THINK[:k] for k in range(len(_THINK), 0, -1) if first.endswith(_THINK[:k])), "")
        opening = _NO_THINK if first.endswith(_NO_THINK) else opening
        thinks = opening not in ("", _NO_THINK)
        reply = (lambda x: _THINK + x) if thinks else (lambda x: x)  # an assistant message's text
        sampled = (lambda x: reply(x)[len(opening) :]) if thinks else reply  # what the model samples of it
        cut, thinking = 0, ""
        if opening and not render(_A, reply(_B), _C).startswith(first + sampled(_B)):
            cut, thinking, sampled = len(opening), "drops", (lambda x: x)  # earlier thinking dropped
        head = lambda text: text[: len(text) - cut]  # noqa: E731 (a prompt up to its header)
        second, third = render(_A, reply(_B), _C), render(_A, reply(_B), _C, reply(_D), _E)
        if not second.startswith(head(first) + sampled(_B)) or _C not in second:
            raise ValueError(refuse)
        if not third.startswith(head(second) + sampled(_D)):
            raise ValueError(refuse)
        mid = second[len(head(first) + sampled(_B)) :]
        close_open, after = mid.split(_C)
        if third[len(head(second) + sampled(_D)) :] != mid.replace(_C, _E):  # the same suffix every turn
            raise ValueError(refuse)
        # where the closing ends and the message begins: the template's closing of an assistant turn alone
        # (read after the reply: a template may write more before the last turn's reply, as Qwen3 an empty
        # <think> block)
        alone = render(_A, reply(_B))
        closing = alone[alone.rfind(_B) + len(_B) :] if _B in alone else ""
        k = len(closing) if close_open.startswith(closing) and closing else 0
        quoted = render(_A, reply(_B), _Q)[len(head(first) + sampled(_B)) :]
        way = next((w for w in WAYS if quoted == close_open + written(_Q, w) + after), "")
        thinking = thinking if opening else _thinking(render, first, refuse)
        return cls(close=close_open[:k], open=close_open[k:], after=after, eos_text=eos, specials=specials,
                   thinking=thinking, way=way, opening=opening if thinks else "")  # fmt: skip

    def observation_text(self, observation: str, ended_on_eos: bool | str) -> str:
        """What follows an assistant turn's sampled tokens: its closing, the observation (as the template
        writes it), the next header. `ended_on_eos`: the text of the EOS token the turn ended on (True: the
        tokenizer's EOS), or '' / False: the closing is written whole."""
        close, eos = self.close, self.eos_text if ended_on_eos is True else ended_on_eos or ""
        if eos and close.startswith(eos):
            close = close[len(eos) :]  # the sampled EOS token is that text
        return close + self.open + written(observation, self.way) + self.after

    def observation_ids(self, tokenizer, observation: str, ended_on_eos: bool | str) -> list[int]:
        """The token ids of observation_text. The observation stays text: a control token's text in it (an
        environment echoing '<|im_end|>\\n<|im_start|>assistant') is tokenized as plain characters, never as
        the control token, so no environment can forge the turn structure. An observation without such text
        is tokenized in one piece with the template's text around it, as it always was."""
        text, shown = self.observation_text(observation, ended_on_eos), written(observation, self.way)
        if not any(s in shown for s in self.specials):
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        head = text[: len(text) - len(shown) - len(self.after)]

        def ids(s: str, **kw) -> list[int]:
            return tokenizer(s, add_special_tokens=False, **kw)["input_ids"]

        return ids(head) + ids(shown, split_special_tokens=True) + ids(self.after)


def _thinking(render, first: str, refuse: str) -> str:
    """What a template does to the <think> blocks of earlier assistant turns, on the made-up conversation with
    thinking turns: '' (keeps them) or 'drops' (Qwen3's, once a user message follows: accepted, and said at
    start-up, envs/spec.py); a template that rewrites them otherwise is refused (`refuse`)."""
    if first.rstrip().endswith("</think>"):  # the prompt closes an empty block: the model does not think
        return ""
    second = render(_A, _THINK + _B, _C)
    third = render(_A, _THINK + _B, _C, _THINK + _D, _E)
    if second.startswith(first + _THINK + _B) and third.startswith(second + _THINK + _D):
        return ""
    if "THOUGHT-6e1b" in second:  # kept, but not as it was written
        raise ValueError(refuse)
    return "drops"


def special_texts(tokenizer) -> tuple[str, ...]:
    """The texts of a tokenizer's control tokens: its special tokens and the added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {*getattr(tokenizer, "all_special_tokens", ()), *(t.content for t in added.values() if t.special)}
    return tuple(sorted(t for t in texts if t))
