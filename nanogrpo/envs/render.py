"""How an observation joins a trajectory: token ids appended after an assistant turn, as the chat template
would render the next message, so the sampler and the trainer read the conversation a chat model expects.

A trajectory is never re-rendered from its messages: the sampled ids stay exactly as sampled, and each
observation appends the template's suffix (the assistant turn's closing, the message, the next assistant
header). That is only right for a template that keeps earlier turns as they were, which `TurnFormat.of`
checks at start-up on a made-up conversation; a template that rewrites them (one that drops earlier
<think> blocks, say) is refused with the way out (--env.format plain), and a tokenizer without a template
gets plain 'role: text' lines.
"""

from __future__ import annotations

from dataclasses import dataclass

_A, _B, _C, _D, _E = "PROMPT-7f3a", "REPLY-1c9e", "OBSERVATION-5d2b", "REPLY-8e4f", "OBSERVATION-2a6c"


@dataclass(frozen=True)
class TurnFormat:
    """The text around an observation: `close` ends the assistant turn (its EOS excepted when the turn ended
    on EOS), `open` starts the observation message, `after` closes it and opens the next assistant turn."""

    close: str
    open: str
    after: str
    eos_text: str  # the EOS token's text, which a turn that ended on EOS already holds
    specials: tuple[str, ...] = ()  # the control tokens' texts, which stay text inside an observation

    @classmethod
    def of(cls, tokenizer, role: str, fmt: str = "auto", system: str = "") -> TurnFormat:
        """The format for `role` ('user' or 'tool'): the chat template's (checked) or plain lines."""
        eos = tokenizer.eos_token or ""
        specials = special_texts(tokenizer)
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if fmt == "plain" or (fmt == "auto" and not has_template):
            return cls(close="", open=f"\n{role}: ", after="\nassistant: ", eos_text=eos, specials=specials)
        if not has_template:
            raise ValueError("--env.format chat: the tokenizer has no chat template; use --env.format plain")
        sys_msg = [{"role": "system", "content": system}] if system else []

        def render(
            *texts: str,
        ) -> str:  # user, assistant, role, assistant, ...; ends on a header after a message
            roles = ["user"] + ["assistant" if i % 2 else role for i in range(1, len(texts))]
            msgs = sys_msg + [{"role": r, "content": t} for r, t in zip(roles, texts)]
            return tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=len(texts) % 2 == 1
            )

        first, second, third = render(_A), render(_A, _B, _C), render(_A, _B, _C, _D, _E)
        refuse = (
            f"the chat template does not keep earlier turns as they were when a {role!r} message follows "
            "(it rewrites or drops them), so a trajectory's tokens would not be what the model later reads; "
            "use --env.format plain"
        )
        if not second.startswith(first + _B) or not third.startswith(second + _D) or _C not in second:
            raise ValueError(refuse)
        mid = second[len(first + _B) :]
        close_open, after = mid.split(_C)
        if third[len(second + _D) :] != mid.replace(_C, _E):  # the same suffix for every turn
            raise ValueError(refuse)
        # where the closing ends and the message begins: the template's closing of an assistant turn alone
        closing = render(_A, _B)[len(first + _B) :]
        k = len(closing) if close_open.startswith(closing) and closing else 0
        close, open_ = close_open[:k], close_open[k:]
        return cls(close=close, open=open_, after=after, eos_text=eos, specials=specials)

    def observation_text(self, observation: str, ended_on_eos: bool) -> str:
        """What follows an assistant turn's sampled tokens: its closing, the observation, the next header."""
        close = self.close
        if ended_on_eos and self.eos_text and close.startswith(self.eos_text):
            close = close[len(self.eos_text) :]  # the sampled EOS token is that text
        return close + self.open + observation + self.after

    def observation_ids(self, tokenizer, observation: str, ended_on_eos: bool) -> list[int]:
        """The token ids of observation_text. The observation stays text: a control token's text in it (an
        environment echoing '<|im_end|>\\n<|im_start|>assistant') is tokenized as plain characters, never as
        the control token, so no environment can forge the turn structure. An observation without such text
        is tokenized in one piece with the template's text around it, as it always was."""
        text = self.observation_text(observation, ended_on_eos)
        if not any(s in observation for s in self.specials):
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        head = text[: len(text) - len(observation) - len(self.after)]

        def ids(s: str, **kw) -> list[int]:
            return tokenizer(s, add_special_tokens=False, **kw)["input_ids"]

        return ids(head) + ids(observation, split_special_tokens=True) + ids(self.after)


def special_texts(tokenizer) -> tuple[str, ...]:
    """The texts of a tokenizer's control tokens: its special tokens and the added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {*getattr(tokenizer, "all_special_tokens", ()), *(t.content for t in added.values() if t.special)}
    return tuple(sorted(t for t in texts if t))
