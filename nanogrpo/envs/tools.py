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

Where this departs from TRL:
  - the call is plain text for every model, not the chat template's tool format, and one call a turn (the
    turn stops at </tool>): <tool>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool>; "parameters" is read
    as "arguments", and arguments sent as a JSON string are decoded;
  - the first message is the row's prompt (of a chat prompt, its last message's text), reset's text after a
    blank line (TRL appends it to the last user message as is), then the tool list and the call format: the
    same for every episode of a row;
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


def call_maybe_async(fn, *args, **kwargs):
    """fn(...), awaited when it is a coroutine (TRL allows async tools and get_reward)."""
    out = fn(*args, **kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


# -- TRL-style tool classes --------------------------------------------------------------------------------

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"


class ToolCallError(ValueError):
    """A tool call the model wrote that cannot run; its message is what the model reads."""


def parse_tool_call(text: str) -> tuple[str, dict] | None:
    """(tool name, arguments) of the first <tool>...</tool> in a turn; None when it has no <tool>;
    ToolCallError saying what is wrong when the call is not {"name": str, "arguments": {...}}."""
    start = text.find(TOOL_OPEN)
    if start < 0:
        return None
    end = text.find(TOOL_CLOSE, start)
    if end < 0:
        raise ToolCallError(f"the tool call has no closing {TOOL_CLOSE}")
    body = text[start + len(TOOL_OPEN) : end].strip().strip("`").strip()
    body = body.removeprefix("json").strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not JSON ({e.msg} at character {e.pos})") from e
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('write the call as {"name": "TOOL", "arguments": {...}}')
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # arguments sent as a JSON string, as OpenAI's API does
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the arguments are not JSON ({e.msg})") from e
    if not isinstance(args, dict):
        raise ToolCallError(f"the arguments must be a JSON object, got {type(args).__name__}")
    return call["name"], args


def tool_methods(obj: Any) -> dict[str, Any]:
    """The tools of a TRL-style instance, by name (sorted): its public methods but reset and get_reward."""
    return {
        name: m
        for name, m in inspect.getmembers(obj, predicate=inspect.ismethod)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    }


def tool_prompt(schemas: list[dict]) -> str:
    """The tool list and the call format, from the tools' JSON schemas (deterministic: the class decides it)."""
    lines = ["You can call these tools:"]
    for s in schemas:
        f = s["function"]
        props, required = f["parameters"].get("properties", {}), f["parameters"].get("required", [])
        sig = ", ".join(f"{k}: {p.get('type', 'any')}{'' if k in required else ' (optional)'}"
                        for k, p in props.items())  # fmt: skip
        lines.append(f"- {f['name']}({sig}): {f.get('description', '')}".rstrip())
        lines += [f"    {k}: {p['description']}" for k, p in props.items() if p.get("description")]
    first, values = (
        schemas[0]["function"],
        {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}},
    )
    args = {
        k: values.get(p.get("type"), "text") for k, p in first["parameters"].get("properties", {}).items()
    }
    example = json.dumps({"name": first["name"], "arguments": args})  # placeholder values by type
    lines.append(
        f"To call a tool, write {TOOL_OPEN}{example}{TOOL_CLOSE} and stop; its result comes back in the next "
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

    stop, role = (TOOL_CLOSE,), "tool"

    def __init__(self, cls: type, schemas: list[dict]):
        self.obj, self.schemas = cls(), schemas
        self.max_turns = int(getattr(cls, "max_turns", 8))
        self.reward_range = tuple(getattr(cls, "reward_range", (0.0, 1.0)))
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
        parts = [
            _prompt_text(row.get("prompt")),
            "" if extra is None else str(extra),
            tool_prompt(self.schemas),
        ]
        self.total = 0.0  # the steps' changes sum to the class's reward, as TRL reads it at the end
        return "\n\n".join(p for p in parts if p.strip())

    def _change(self) -> float:
        now = self.reward_now()
        change, self.total = now - self.total, now
        return change

    def step(self, text: str) -> Step:
        try:
            call = parse_tool_call(text)
            if call is None:  # no tool call: the model's answer ends the episode
                return Step(None, self._change(), True, {})
            name, args = call
            tools = tool_methods(self.obj)
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
        except ToolCallError as e:
            return Step(json.dumps({"error": str(e)}), self._change(), False, {"invalid": True})
        obs = result if isinstance(result, str) else json.dumps(result, default=str)
        return Step(obs, self._change(), False, {"tool": name})


def tool_class_factory(cls: type):
    """The factory of a TRL-style class's trajectories; its tools' schemas are made (and checked) now."""
    from transformers.utils import get_json_schema

    label = f"tool class {cls.__name__}"
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"{label}: define reset(self, **row) (it may return text for the first message)")
    try:
        probe = cls()
    except Exception as e:
        raise ValueError(
            f"{label}: {cls.__name__}() failed ({type(e).__name__}: {e}); __init__ takes no argument"
        ) from e
    tools = tool_methods(probe)
    if not tools:
        raise ValueError(f"{label} has no tool: each public method but reset and get_reward is one")
    schemas = []
    for name, method in tools.items():
        try:
            schemas.append(get_json_schema(method))
        except Exception as e:  # no docstring, an argument without a type hint or description
            raise ValueError(
                f"{label}: tool {name}: {e} (a tool needs type hints and a docstring with Args:)"
            ) from e
    return functools.partial(ToolEnv, cls, schemas)


@register("trl")
def _trl(target: str):
    return tool_class_factory(import_class(target, f"trl:{target}"))
