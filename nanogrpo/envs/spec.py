"""An environment as a run uses it, resolved once at start-up (EnvSpec): the factory, the protocol's attributes
read from one instance, the budgets, the time limit, the turn format and the prompt limit, and the worker
processes its instances run in (envs/workers.py). The episode loop and the evaluations read this one spec.

    cfg, env = resolve(cfg)                                  # before the data: the budgets set the prompt limit
    env = check_start(env, tok, rows, system_prompt, limit, positions, episodes)   # before the model loads

Everything is checked here, before any model loads, each fault one line that says how to fix it: an unknown
name or a file that does not import; an instance that cannot be built without arguments, or whose attributes
are wrong (read once, here: an instance that changes them later changes nothing); a chat template that
rewrites earlier turns; a reset that fails on the first row; a first message that does not fit the prompt limit
the budgets leave (the model's positions less --env.max-tokens).

Two things are said in one line each: how an environment's tools are called (envs/tool_calls.py: the chat
template's own format, or the plain one), and a thinking template that drops earlier <think> blocks from the
history it renders (envs/render.py: the history keeps the sampled thinking).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from nanogrpo.envs import make_factory, tool_calls
from nanogrpo.envs.keeper import printable
from nanogrpo.envs.render import TurnFormat
from nanogrpo.envs.workers import Workers

CHARS_PER_TOKEN = 16
"""An observation is cut at this many characters per token of the episode's budget before it is tokenized (a
first message: per token of the prompt limit): more than any tokenizer's tokens hold on average, so only text
that could never fit is cut."""


@dataclass(frozen=True)
class EnvSpec:
    """An environment resolved for a run: what the episode loop, the evaluations and the logs need of it."""

    label: str
    """How messages name it: the --env.name or --env.spec given."""
    factory: Callable[[], Any] = field(repr=False)
    """Makes one instance (one episode); called in a worker process."""
    max_turns: int
    """Assistant turns an episode may take: --env.max-turns, at most the environment's own."""
    max_tokens: int
    """An episode's token budget after the prompt, sampled plus observation tokens (--env.max-tokens)."""
    stop: tuple[str, ...]
    """The environment's strings that end a turn (the run's --sampling.stop are added to them)."""
    role: str
    """The role observations are rendered with: 'user' or 'tool'."""
    reward_range: tuple[float, float]
    """The episode reward's range, which the `env` grader maps onto [0, 1]."""
    timeout_s: float
    """Seconds one call (construct, reset, step) may take (--env.step-timeout-s; 0 = no limit)."""
    format: str = "auto"
    """--env.format: how observations join the conversation."""
    turns: TurnFormat | None = None
    """The text around an observation (check_start sets it from the tokenizer)."""
    prompt_limit: int = 1 << 30
    """The longest first message, in tokens (check_start sets it)."""
    cut_reward: float | None = None
    """The reward of an episode a budget cut before it was done (--env.truncated-score placed in reward_range);
    None: the sum of its steps' rewards."""
    tools: tuple[dict, ...] = ()
    """The environment's tools, as JSON schemas (its `tools` attribute); () for an environment without."""
    own_turns: int = 0
    """The environment's own max_turns (max_turns is at most it)."""
    tool_format: str = "auto"
    """--env.tool-format: 'auto' (the chat template's own call format) or 'plain'."""
    calls: str = ""
    """The call format the run uses, a name of tool_calls.FORMATS (check_start sets it; '' without tools)."""
    workers: Workers | None = field(default=None, repr=False, compare=False)
    """The worker processes its instances run in."""

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools the chat template renders into the first message (tools=): a native call format's."""
        native = self.calls and tool_calls.FORMATS[self.calls].native
        return list(self.tools) if native else None

    def first_ids(self, tok, row: dict, message: str | None, system_prompt: str) -> list[int]:
        """The token ids of an episode's first message: reset's text, or (None) the row's prompt, rendered
        once at start-up and here again only when the template renders the tools with it."""
        from nanogrpo.data import render_prompt

        if message is None and self.template_tools is None:
            return row["_prompt_ids"]
        prompt = row if message is None else {"prompt": message}
        return render_prompt(tok, prompt, system_prompt, tools=self.template_tools)

    @property
    def max_chars(self) -> int:
        """Where an observation is cut before it is tokenized."""
        return CHARS_PER_TOKEN * self.max_tokens

    @property
    def first_chars(self) -> int:
        """Where a first message is cut before it is tokenized."""
        return CHARS_PER_TOKEN * self.prompt_limit


def resolve(cfg):
    """(cfg with --env.max-turns and --env.max-tokens resolved, the EnvSpec), or (cfg, None) without --env."""
    if not cfg.env.on:
        return cfg, None
    env = resolve_env(cfg.env, cfg.sampling.max_new_tokens, cfg.reward.allow_user_code)
    return replace(cfg, env=replace(cfg.env, max_turns=env.max_turns, max_tokens=env.max_tokens)), env


def resolve_env(
    e, max_new_tokens: int, allow_user_code: bool = False, allow_flag: str = "--reward.allow-user-code"
) -> EnvSpec | None:
    """The EnvSpec of the EnvConfig `e` (--env.* of train.py or eval.py generate); None without an environment,
    where a --env.* flag given is refused (it would change nothing)."""
    e.check_used()
    if not e.on:
        return None
    factory = make_factory(e.name, e.spec, allow_user_code, allow_flag)
    return build_spec(factory, e.name or e.spec, e, max_new_tokens)


def build_spec(factory: Callable[[], Any], label: str, e, max_new_tokens: int) -> EnvSpec:
    """The EnvSpec of a factory under the EnvConfig `e`: one instance built in a worker and its attributes read
    and checked there; max_turns the flag's (at most the environment's own), max_tokens the flag's or
    max_turns x (max_new_tokens + 64)."""
    workers = Workers(factory, e.step_timeout_s)
    _first_call(workers, "make", None, label)  # built as every episode's instance will be: in a worker
    attrs = _first_call(workers, "attrs", None, label)
    workers.call({0: ("end", None)})
    if e.tool_format != "auto" and not attrs["tools"]:
        workers.close()
        raise ValueError(
            f"--env.tool-format {e.tool_format}: environment {label!r} has no tools (its `tools` attribute, or a "
            "TRL-style class's methods), so there is no call to format; drop the flag"
        )
    turns = min(e.max_turns, attrs["max_turns"]) if e.max_turns else attrs["max_turns"]
    tokens = e.max_tokens or turns * (max_new_tokens + 64)
    (lo, hi), frac = attrs["reward_range"], e.truncated_score  # where a budget-cut episode lands
    return EnvSpec(
        label, factory, turns, tokens, attrs["stop"], attrs["role"], attrs["reward_range"], e.step_timeout_s,
        e.format, workers=workers, cut_reward=None if frac == -1 else lo + frac * (hi - lo),
        tools=attrs["tools"], tool_format=e.tool_format, own_turns=attrs["max_turns"],
    )  # fmt: skip


def _first_call(workers: Workers, op: str, arg, label: str, where: str = "") -> Any:
    """A start-up call on worker 0; its failure a ValueError that says what to fix."""
    value, err = workers.call({0: (op, arg)})[0]
    if not err:
        return value
    if err.endswith(" s") and "over" in err:
        err += " (--env.step-timeout-s sets the limit)"
    elif err.startswith("make: TypeError"):
        err += " (an environment is built with no arguments, one instance per episode)"
    workers.close()
    raise ValueError(f"environment {label!r}: {printable(err)}{where}")


def check_start(
    env: EnvSpec, tok, rows: list[dict], system_prompt: str, limit: int, positions: int, episodes: int,
    decode: str = "eager",
) -> EnvSpec:  # fmt: skip
    """The spec completed with the tokenizer, and checked against the data, before the model loads: the chat
    template keeps earlier turns (envs/render.py), reset works on the first row, and its first message fits
    the prompt limit `limit` (of the model's `positions`). Forks the `episodes` workers a rollout uses, while
    the process is small. `decode` (--sampling.decode): a mode whose grouped cache cannot continue an
    episode's rows says so in one line."""
    from nanogrpo.infra import dist

    if decode in ("eager", "static") and dist.is_main():
        print(
            "note: episodes sample with the row sampler, a cache row of its own continued from turn to turn (the "
            f"grouped cache of --sampling.decode {decode} shares a prompt's keys among rows that part after turn 1)"
        )
    if env.tools:
        env = with_calls(env, tok)
    fmt = TurnFormat.of(tok, env.role, env.format, system_prompt, env.template_tools)
    if fmt.thinking and dist.is_main():
        print(THINKING_LINE)
    assert env.workers is not None
    _first_call(env.workers, "make", None, env.label)
    message = _first_call(
        env.workers,
        "reset",
        (dict(rows[0]), 0, CHARS_PER_TOKEN * limit),
        env.label,
        " (on the data's first row: reset reads what the rows hold)",
    )
    env.workers.call({0: ("end", None)})
    if message is not None or env.template_tools is not None:
        n = len(env.first_ids(tok, dict(rows[0]), message, system_prompt))
        if n > limit:
            env.workers.close()
            room = positions - env.max_tokens
            why = (
                f"--data.max-prompt-tokens {limit}" if limit < room else
                f"the model's {positions} positions less the episode budget --env.max-tokens {env.max_tokens} "
                f"({env.max_turns} turns)"
            )  # fmt: skip
            raise ValueError(
                f"environment {env.label!r}: its first message is {n} tokens, over the prompt limit of {limit} "
                f"({why}); lower --env.max-turns or --env.max-tokens, raise --data.max-prompt-tokens, or use a "
                "model with more positions"
            )
    env.workers.grow(episodes)
    return replace(env, turns=fmt, prompt_limit=limit)


THINKING_LINE = (
    "note: the chat template drops the <think> blocks of earlier assistant turns; episodes keep the sampled "
    "thinking in their history (what the model wrote is what it reads next and is trained on), so a deployment "
    "that re-renders the history through this template shows the model a context without its earlier thinking, "
    "one it was not trained on (docs/ENVS.md)"
)


def _with_format(factory: Callable[[], Any], name: str):
    """An instance of `factory` that writes its tool calls in the format `name` (set before reset)."""
    env = factory()
    env.tool_format = name
    return env


def with_calls(env: EnvSpec, tok) -> EnvSpec:
    """The spec with its call format chosen from the tokenizer (said in one line): each instance told the
    format (its worker forked anew with that factory) and the format's closing tag among the stop strings."""
    from nanogrpo.infra import dist

    forced_by = next((f"{flag} plain" for flag, v in (("--env.format", env.format), ("--env.tool-format", env.tool_format))
                      if v == "plain"), "")  # fmt: skip
    calls = tool_calls.choose(tok, "plain" if forced_by else "auto")
    if dist.is_main():
        print(tool_calls.startup_line(calls, forced_by))
    assert env.workers is not None
    env.workers.close()
    factory = functools.partial(_with_format, env.factory, calls.name)
    stop = tuple(dict.fromkeys((*env.stop, *calls.stop)))
    workers = Workers(factory, env.timeout_s)
    return replace(env, factory=factory, stop=stop, calls=calls.name, workers=workers)
