"""Multi-turn environments: the protocol, the registry, and how a run picks one (--env.name / --env.spec).

An environment turns one completion into an episode. One instance plays one trajectory:

    class Guess(Environment):
        max_turns, stop, role, reward_range = 6, (), "user", (0.0, 1.0)
        def reset(self, row: dict, seed: int) -> str | None: ...   # the first user message; None: row's prompt
        def step(self, text: str) -> Step: ...                      # the turn's decoded completion

`step` answers each assistant turn with `Step(observation, reward, done, info)`; the episode's reward is the
sum of its steps' rewards (the `env` grader maps it from `reward_range` into [0, 1]). The G members of a
group reset with the same seed, so their advantages compare G answers to one situation. `info` may carry
`invalid: True` (an action the environment could not use: the `invalid` grader counts them).

Every instance runs in a worker process (envs/workers.py), so that nothing an environment does (raise, hang,
return what the protocol does not allow, kill its process) takes the run down: the episode ends instead.
A run resolves its environment once, at start-up, into an EnvSpec (envs/spec.py); `protocol_attrs` below is
the one check of an instance's attributes.

Where this departs from peers: TRL's environment classes expose tools as methods and OpenEnv's and
TextArena's `step` take an action object; those are adapters (envs/tools.py, textarena.py, openenv.py) onto this one protocol,
so the episode loop (envs/episode.py) is the same for all of them. TRL calls environments in its own
process with no time limit; OpenEnv and verifiers isolate them in servers: nanogrpo isolates each
episode's instance in a process of its own, with a limit on every call.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import Any


@dataclass
class Step:
    """What an environment answers to one assistant turn."""

    observation: str | None
    """The next message the model reads (None: an empty one); ignored when done."""
    reward: float = 0.0
    """This step's reward; the episode's reward is the sum over its steps."""
    done: bool = False
    """The episode is over (solved, failed, or the environment's own limit)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to log; `invalid: True` marks an action the environment could not use."""


class Environment:
    """Base class of an environment (subclassing it is optional: the attributes and two methods are the
    protocol). One instance per trajectory; reset is called once, then step once per assistant turn."""

    max_turns: int = 4
    """Assistant turns at most (--env.max-turns may lower it)."""
    stop: tuple[str, ...] = ()
    """Strings that end a turn (besides EOS), e.g. '</calc>' for a tool call; kept in the text."""
    role: str = "user"
    """The role observations are rendered with: 'user' or 'tool'."""
    reward_range: tuple[float, float] = (0.0, 1.0)
    """The episode reward's range, which the `env` grader maps onto [0, 1]."""
    tools: tuple[dict, ...] = ()
    """Tools the model calls, as JSON schemas ({"type": "function", "function": {"name", "description",
    "parameters"}}): given, they go to the chat template as tools= where it renders them, and the run sets
    `tool_format` before reset (envs/tool_calls.py reads a call: parse_tool_call(text, FORMATS[tool_format]))."""
    tool_format: str = "plain"
    """How this run's model writes a call: 'plain', 'hermes' or 'llama3' (set by the run; envs/tool_calls.py)."""

    def reset(self, row: dict, seed: int) -> str | None:
        return None

    def step(self, text: str) -> Step:
        raise NotImplementedError


Factory = Callable[[], Any]  # makes one environment instance
_REGISTRY: dict[str, Callable[[str], Factory]] = {}  # name -> make(argument after 'name:') -> factory


def need(module: str, package: str, label: str) -> None:
    """A ValueError naming the pip package when `module` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"{label} needs the {package} package: pip install {package} (or pip install -e '.[envs]')"
        )


def import_class(target: str, label: str) -> type:
    """The class of 'package.module:ClassName', with a ValueError that says how to fix a bad name."""
    module, sep, name = target.rpartition(":")
    if not sep or not module or not name.isidentifier():
        raise ValueError(f"--env.name {label}: write {label.split(':')[0]}:package.module:ClassName")
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError as e:
        raise ValueError(f"--env.name {label}: importing {module} failed: {e}") from e
    if not isinstance(cls, type):
        raise ValueError(f"--env.name {label}: module {module} has no class {name!r}")
    return cls


def accepted(fn, kwargs: dict) -> dict:
    """The keyword arguments fn's signature takes (all of them when it has **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in {p.name for p in params}}


def register(name: str) -> Callable:
    """`@register("guess")` on a class (no argument) or on `def make(arg: str) -> factory` for names that
    take one after a colon ('textarena:GuessTheNumber-v0')."""

    def deco(obj):
        _REGISTRY[name] = (lambda arg: obj) if isinstance(obj, type) else obj
        return obj

    return deco


def known() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    from nanogrpo.envs import builtin, openenv, textarena, tools  # noqa: F401  (their @register lines fill the registry)


def load_user_class(spec: str, flag: str = "--env.spec") -> type:
    """The class of 'path.py:Class' (imported fresh), with a ValueError that says how to fix a bad spec."""
    path, sep, name = spec.rpartition(":")
    file = Path(path).expanduser()
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise ValueError(f"{flag} {spec!r}: write path/to/file.py:ClassName")
    if not file.is_file():
        raise ValueError(
            f"{flag} {spec!r}: no file {str(file)!r} (a relative path is read from the working directory)"
        )
    mod_name = f"_nanogrpo_env_{abs(hash(str(file.resolve())))}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, file)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_name] = module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"{flag} {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{flag} {spec!r}: {path} defines no class {name!r}")
    return cls


def make_factory(
    name: str = "",
    spec: str = "",
    allow_user_code: bool = False,
    allow_flag: str = "--reward.allow-user-code",
) -> Factory:
    """The factory of --env.name NAME[:ARG] or --env.spec path.py:Class (behind `allow_flag`, as user graders
    are). An adapter checks what it can now (a package, a server, a game id); the instance itself is built and
    checked in a worker process (envs/spec.py)."""
    if bool(name) == bool(spec):
        raise ValueError("give one of --env.name (a built-in or adapter) and --env.spec (path.py:Class)")
    if spec:
        if not allow_user_code:
            raise ValueError(f"--env.spec {spec!r} runs your Python code; add {allow_flag} to allow it")
        factory = load_user_class(spec)
        from nanogrpo.envs.tools import is_tool_class, tool_class_factory

        return tool_class_factory(factory) if is_tool_class(factory) else factory
    _load_builtins()
    key, _, arg = name.partition(":")
    if key not in _REGISTRY:
        raise ValueError(f"--env.name {name!r}: unknown environment; use one of {', '.join(known())}")
    return _REGISTRY[key](arg)


def protocol_attrs(env: Any) -> dict[str, Any]:
    """The protocol's attributes of one instance (the base class's defaults where it sets none), checked:
    a ValueError naming the attribute that is wrong and what it must be."""
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ValueError(f"it has no {method}() method (see docs/ENVS.md)")
    names = ("max_turns", "stop", "role", "reward_range", "tools")
    return checked_attrs({k: getattr(env, k, getattr(Environment, k)) for k in names})


def checked_attrs(a: dict[str, Any]) -> dict[str, Any]:
    """The protocol's attributes `a` checked and made plain (tuples, floats, the tools as JSON data); a
    ValueError naming the one that is wrong. The worker reads them off an instance with this check, and the
    trainer checks its reply with it again."""
    turns, stop, role, span = a["max_turns"], a["stop"], a["role"], a["reward_range"]
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ValueError(f"max_turns {turns!r} must be a whole number >= 1")
    if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop {stop!r} must be a tuple of non-empty strings, e.g. ('</calc>',) or ()")
    if role not in ("user", "tool"):
        raise ValueError(f"role {role!r} must be 'user' or 'tool'")
    numbers = isinstance(span, (tuple, list)) and len(span) == 2
    numbers = numbers and all(isinstance(x, Real) and not isinstance(x, bool) for x in span)
    if not numbers:
        raise ValueError(f"reward_range {span!r} must be two numbers (low, high)")
    lo, hi = float(span[0]), float(span[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi and math.isfinite(hi - lo)):
        raise ValueError(
            f"reward_range {(lo, hi)} must be two finite numbers, low < high, whose difference is finite "
            "(the `env` grader divides by it)"
        )
    tools = a["tools"] or ()
    try:  # plain data, as the chat template and the trainer's process take it, each tool a named function
        tools = json.loads(json.dumps(list(tools), allow_nan=False))
        named = all(isinstance(t["function"]["name"], str) for t in tools)
    except (TypeError, ValueError, KeyError):
        named = False
    if not named:
        raise ValueError('tools must be JSON schemas, each {"type": "function", "function": {"name": ...}}')
    return {"max_turns": turns, "stop": tuple(stop), "role": role, "reward_range": (lo, hi),
            "tools": tuple(tools)}  # fmt: skip
