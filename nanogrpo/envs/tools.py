"""TRL-style tool classes as environments (the protocol of nanogrpo/envs/__init__.py): an instance plays one
trajectory with reset(row, seed) -> first message and step(text) -> Step, so one episode loop runs them, as it
runs TextArena's games (envs/textarena.py) and OpenEnv's (envs/openenv.py); reasoning-gym is a data source and
grader for single-turn runs (rewards/reasoninggym.py), not an environment.

TRL-style tool classes: --env.spec path.py:Class (behind --reward.allow-user-code), or an importable one as
--env.name trl:package.module:Class. The class is what TRL's GRPOTrainer takes as `environment_factory`:
`__init__()` takes no argument; `reset(**row)` is called at the start of each episode and may return text;
every public method but reset and get_reward is a tool, described to the model by transformers'
get_json_schema (type hints and the docstring's Args:, which TRL requires too); a tool that raises is answered
{"error": "..."}; the reward is `get_reward()`, else the `reward` attribute, else 0 (then grade the last answer
with --reward.spec as TRL's reward_funcs would). Optional class attributes: max_turns (8), reward_range ((0, 1)).

The calls are in the model's own format where its chat template has one (envs/tool_calls.py: Hermes-style
<tool_call> JSON for Qwen2.5 / Qwen3, bare JSON for Llama 3.x; the tools go to the template as tools=), else
in the plain one, <tool>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool>, with the tool list and that form
written into the first message. The run sets `tool_format` on each instance before reset (envs/spec.py).
Each step's info says how many calls the turn held (`tool_calls`) and, for one that did not parse, why
(`tool_parse_error`, also the observation the model reads).

Where this departs from TRL:
  - one call a turn (the turn stops at the format's closing tag); "parameters" is read as "arguments", and
    arguments sent as a JSON string are decoded;
  - the first message is the row's prompt (of a chat prompt, its last message's text), reset's text after a
    blank line (TRL appends it to the last user message as is), and in the plain format the tool list and the
    call form: the same for every episode of a row;
  - reset gets the row fields its signature names (all of them with **kwargs), and `seed` if it names one;
  - the reward is read after every turn and each step returns its change, so an episode's reward is the
    class's reward when the episode ends, on a budget too (TRL reads it once, at the end);
  - a result that is not text is sent as JSON (TRL: str()); a call that cannot run (no closing tag, not JSON,
    an unknown tool or argument, the tool raised) is answered {"error": "..."} with info invalid.
A turn without a tool call ends the episode.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from typing import Any

from nanogrpo.envs import Environment, Step, accepted, import_class, register
from nanogrpo.envs.tool_calls import FORMATS, PLAIN, ToolCallError, parse_tool_call


def call_maybe_async(fn, *args, **kwargs):
    """fn(...), awaited when it is a coroutine (TRL allows async tools and get_reward)."""
    out = fn(*args, **kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


# -- TRL-style tool classes --------------------------------------------------------------------------------


def tool_methods(obj: Any) -> dict[str, Any]:
    """The tools of a TRL-style instance, by name (sorted): its public methods but reset and get_reward, `step`
    included. Found without running anything else of the instance: a property is not a tool, and is not read."""
    tools = {}
    for name in sorted(dir(obj)):
        if name.startswith("_") or name in ("reset", "get_reward"):
            continue
        static = inspect.getattr_static(obj, name, None)
        if inspect.isfunction(static) or isinstance(static, classmethod) or inspect.ismethod(static):
            method = getattr(obj, name)
            if inspect.ismethod(method):
                tools[name] = method
    return tools


def _types(p: dict) -> list[str]:
    """A parameter's JSON types: ['integer', 'string'] for a union, ['any'] when the schema names none."""
    t = p.get("type") or "any"
    return [str(x) for x in t] if isinstance(t, list) else [str(t)]


def tool_prompt(schemas: list[dict]) -> str:
    """The tool list and the call format, from the tools' JSON schemas (deterministic: the class decides it)."""
    lines = ["You can call these tools:"]
    for s in schemas:
        f = s["function"]
        props, required = f["parameters"].get("properties", {}), f["parameters"].get("required", [])
        sig = ", ".join(f"{k}: {'|'.join(_types(p))}{'' if k in required else ' (optional)'}"
                        for k, p in props.items())  # fmt: skip
        lines.append(f"- {f['name']}({sig}): {f.get('description', '')}".rstrip())
        lines += [f"    {k}: {p['description']}" for k, p in props.items() if p.get("description")]
    first, values = (
        schemas[0]["function"],
        {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}},
    )
    args = {k: values.get(_types(p)[0], "text") for k, p in first["parameters"].get("properties", {}).items()}
    lines.append(  # placeholder values by type
        f"To call a tool, write {PLAIN.write(first['name'], args)} and stop; its result comes back in the next "
        "message. When you are done, answer without a tool call."
    )
    return "\n".join(lines)


def _prompt_text(prompt: Any) -> str:
    """A row's prompt as text: itself, or a chat prompt's last message."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return "" if prompt is None else str(prompt)


class ToolEnv(Environment):
    """One trajectory of a TRL-style class: an instance of it, its tools called from the model's text."""

    stop, role = (), "tool"  # the run adds the call format's closing tag to the stop strings
    tool_format = PLAIN.name  # the run sets the model's own format (envs/spec.py) before reset

    def __init__(self, cls: type):
        label = f"tool class {cls.__name__}"
        try:
            self.obj = cls()
        except Exception as e:
            raise ValueError(
                f"{label}: {cls.__name__}() failed ({type(e).__name__}: {e}); __init__ takes no argument"
            ) from e
        self.methods = tool_methods(self.obj)
        if not self.methods:
            raise ValueError(f"{label} has no tool: each public method but reset and get_reward is one")
        self.tools = tool_schemas(self.methods, label)
        self.max_turns = getattr(cls, "max_turns", 8)
        self.reward_range = getattr(cls, "reward_range", (0.0, 1.0))
        self.total = 0.0

    def reward_now(self) -> float:
        if callable(getattr(self.obj, "get_reward", None)):
            return float(call_maybe_async(self.obj.get_reward))
        return float(getattr(self.obj, "reward", 0.0) or 0.0)

    def reset(self, row: dict, seed: int) -> str:
        fields = {k: v for k, v in row.items() if not k.startswith("_")}  # '_'-fields are nanogrpo's own
        if "seed" in inspect.signature(self.obj.reset).parameters and "seed" not in fields:
            fields["seed"] = seed
        extra = call_maybe_async(self.obj.reset, **accepted(self.obj.reset, fields))
        parts = [_prompt_text(row.get("prompt")), "" if extra is None else str(extra)]
        if not FORMATS[self.tool_format].native:  # a native format's tools are the chat template's to render
            parts.append(tool_prompt(self.tools))
        self.total = 0.0  # the steps' changes sum to the class's reward, as TRL reads it at the end
        return "\n\n".join(p for p in parts if p.strip())

    def _change(self) -> float:
        now = self.reward_now()
        change, self.total = now - self.total, now
        return change

    def _run(self, name: str, args: dict) -> str:
        """The result of one call, as text; ToolCallError when it cannot run or the tool raised."""
        tools = self.methods
        if name not in tools:
            raise ToolCallError(f"no tool {name!r}; the tools are {', '.join(tools)}")
        try:
            inspect.signature(tools[name]).bind(**args)
        except TypeError as e:
            raise ToolCallError(f"{name}: {e}") from e
        try:
            result = call_maybe_async(tools[name], **args)
        except Exception as e:  # the tool raised: the model reads the error, as in TRL
            raise ToolCallError(str(e) or type(e).__name__) from e
        return result if isinstance(result, str) else json.dumps(result, default=str)

    def step(self, text: str) -> Step:
        try:
            call = parse_tool_call(text, FORMATS[self.tool_format])
        except ToolCallError as e:  # a call that does not parse: the model reads what is wrong and the form
            info = {"invalid": True, "tool_calls": 0, "tool_parse_error": str(e)}
            return Step(json.dumps({"error": str(e)}), self._change(), False, info)
        if call is None:  # no tool call: the model's answer ends the episode
            return Step(None, self._change(), True, {"tool_calls": 0})
        name, args = call
        try:
            obs = self._run(name, args)
        except (
            ToolCallError
        ) as e:  # a call that parsed but cannot run: no such tool, bad arguments, it raised
            obs, info = json.dumps({"error": str(e)}), {"invalid": True}
        else:
            info = {}
        return Step(obs, self._change(), False, {**info, "tool": name, "tool_calls": 1})


def tool_schemas(tools: dict[str, Any], label: str) -> list[dict]:
    """The JSON schemas of tools by name (OpenAI's function format: name, description, parameters with their
    types, descriptions and which are required), from their type hints and docstrings' Args: sections by
    transformers' get_json_schema, made once per function in a process; a ValueError naming the tool it
    cannot describe."""
    schemas = []
    for name, fn in tools.items():
        try:
            schemas.append(_schema(getattr(fn, "__func__", fn)))
        except Exception as e:  # no docstring, an argument without a type hint or description
            raise ValueError(
                f"{label}: tool {name}: {e} (a tool needs type hints and a docstring with Args:)"
            ) from e
    return schemas


@functools.lru_cache(maxsize=256)
def _schema(fn) -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def is_tool_class(cls: type) -> bool:
    """Whether a user's class is TRL-style (its public methods are tools) rather than a nanogrpo environment:
    an environment subclasses Environment, or has step(text) and a reset that takes (row, seed); any other
    class is a tool class, and a method of it named `step` is a tool like the rest (as in TRL)."""
    if issubclass(cls, Environment):
        return False
    step, reset = inspect.getattr_static(cls, "step", None), inspect.getattr_static(cls, "reset", None)
    if not (inspect.isfunction(step) and inspect.isfunction(reset)):
        return True
    try:
        inspect.signature(reset).bind(None, {}, 0)
        inspect.signature(step).bind(None, "")
    except TypeError:
        return True
    return False


def tool_class_factory(cls: type):
    """The factory of a TRL-style class's trajectories. Nothing of the class runs here: each instance is built
    and inspected (its tools, their schemas) in a worker, under the time limit (envs/workers.py); a class that
    cannot be built, or whose tools cannot be described, is refused at start-up in one line."""
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(
            f"tool class {cls.__name__}: define reset(self, **row) (it may return text for the first message)"
        )
    from transformers.utils import get_json_schema  # noqa: F401  (imported here, not in each worker)

    return functools.partial(ToolEnv, cls)


@register("trl")
def _trl(target: str):
    return tool_class_factory(import_class(target, f"trl:{target}"))
