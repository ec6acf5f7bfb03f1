"""Tool calls in a model's text: the formats nanogrpo reads, and how a run picks the model's own from its chat
template.

    plain   <tool>{"name": "add", "arguments": {"a": 1}}</tool>            any model: the tool list and this form
                                                                           are written into the first message
    hermes  <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>  Qwen2.5, Qwen3 (Hermes-style JSON)
    llama3  {"name": "add", "parameters": {"a": 1}}                        Llama 3.1 / 3.2: the turn is the call

    calls = choose(tokenizer, "auto")      # at start-up: the template's own format, else plain
    name, args = parse_tool_call(text, calls)   # a turn: None when it holds no call; ToolCallError when it
                                                # holds one that does not parse (the message says what is
                                                # wrong and the form expected)

`choose` renders a made-up conversation with `tools=` and an assistant tool call through the template and reads
back which format it wrote: a template that renders no tools (SmolLM2's) gets the plain format. In the native
formats the tools go to the template as `tools=` (the model reads them as it was trained to) and a result comes
back as a `tool` message, rendered by the template (envs/render.py). One call a turn: the turn stops at the
format's closing tag (Llama 3's template allows one call a turn anyway); the arguments may be sent under
"arguments" or "parameters", and as a JSON string (as OpenAI's API sends them); a call written inside a
<think> block is thought, not made: one in a closed block is not read (only what follows </think> is), and one
in a block not closed yet (the turn stopped at the call's closing tag, before </think>) is answered as a call
that cannot run, saying to close the thinking first.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass


class ToolCallError(ValueError):
    """A tool call the model wrote that cannot run; its message is what the model reads."""


@dataclass(frozen=True)
class CallFormat:
    """How calls are written: between `open` and `close` (a tag pair), or as the whole turn when open is ''."""

    name: str  # 'plain', 'hermes', 'llama3'
    open: str
    close: str
    key: str  # what the arguments are written under
    native: bool  # the chat template's own: tools passed as tools=, results as tool messages

    @property
    def stop(self) -> tuple[str, ...]:
        """What ends a turn that calls a tool (besides EOS): one call a turn."""
        return (self.close,) if self.close else ()

    def write(self, name: str, args: dict | str) -> str:
        """A call as this format writes it (args a dict, or text put in as it is: '{...}')."""
        body = json.dumps(args) if isinstance(args, dict) else args
        return f'{self.open}{{"name": "{name}", "{self.key}": {body}}}{self.close}'

    @property
    def form(self) -> str:
        """The expected form, which every parse error names."""
        return self.write("TOOL", "{...}")


PLAIN = CallFormat("plain", "<tool>", "</tool>", "arguments", native=False)
HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>", "arguments", native=True)
LLAMA3 = CallFormat("llama3", "", "", "parameters", native=True)
FORMATS = {f.name: f for f in (PLAIN, HERMES, LLAMA3)}


def parse_tool_call(text: str, fmt: CallFormat = PLAIN) -> tuple[str, dict] | None:
    """(tool name, arguments) of the first call in a turn written in `fmt`; None when the turn holds no call
    (with a tag pair: no opening tag; llama3: the turn does not start with '{'); ToolCallError saying what is
    wrong, and the form expected, when it holds one that does not parse, or one written inside a <think> block
    not closed yet (a thinking model's thought is not read: answer_part)."""
    text, thought = answer_part(text)
    if fmt.open and fmt.open in thought:
        raise ToolCallError(
            f"the tool call is inside a <think> block that is not closed, so it was thought, not made; close the "
            f"thinking with </think>, then write the call as {fmt.form}"
        )
    if fmt.open:
        start = text.find(fmt.open)
        if start < 0:
            return None
        end = text.find(fmt.close, start)
        if end < 0:
            raise ToolCallError(f"the tool call has no closing {fmt.close}; write the call as {fmt.form}")
        body = text[start + len(fmt.open) : end]
    else:  # the turn is the call (a <|python_tag|> before it, where decoding kept it, is not)
        body = text.strip().removeprefix("<|python_tag|>")
        if not body.lstrip().startswith("{"):
            return None
    body = body.strip().strip("`").strip().removeprefix("json").strip()  # a call in a ```json fence
    try:  # what follows the object (an end token's text) is not its
        call, _ = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        why = f"the tool call is not JSON ({e.msg} at character {e.pos})"
        raise ToolCallError(f"{why}; write the call as {fmt.form}") from e
    except RecursionError:
        raise ToolCallError(
            f"the tool call is nested too deeply to read; write the call as {fmt.form}"
        ) from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError(f"the tool call needs a name; write the call as {fmt.form}")
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # arguments sent as a JSON string, as OpenAI's API does
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the arguments are not JSON ({e.msg}); write the call as {fmt.form}") from e
        except RecursionError:
            raise ToolCallError(
                f"the arguments are nested too deeply to read; write the call as {fmt.form}"
            ) from None
    if not isinstance(args, dict):
        raise ToolCallError(
            f"the arguments must be a JSON object, got {type(args).__name__}; write the call as {fmt.form}"
        )
    return call["name"], args


def answer_part(text: str) -> tuple[str, str]:
    """(what a turn says, what it only thinks): the text after its last </think> (as Qwen3's template splits a
    turn), up to a <think> that is not closed; the rest of it, from that <think> on, is thought."""
    text = text.rpartition("</think>")[2]
    said, opened, thought = text.partition("<think>")
    return said, opened + thought


_NAME, _VALUE = "probe_tool_4e7c", "VALUE-9b2f"  # a made-up tool and argument no template writes by itself
_PROBE_TOOL = {"type": "function", "function": {
    "name": _NAME, "description": "A probe.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "a value"}}, "required": ["x"]},
}}  # fmt: skip


def template_format(tokenizer) -> CallFormat:
    """The call format the chat template writes: a user message rendered with `tools=` and an assistant turn
    that calls the probe tool, read back by each native parser. PLAIN when there is no template, when it
    renders no tools (or raises on them), or when no parser reads its call back."""
    if getattr(tokenizer, "chat_template", None) is None:
        return PLAIN
    user = [{"role": "user", "content": "PROMPT-7f3a"}]
    call = {"type": "function", "function": {"name": _NAME, "arguments": {"x": _VALUE}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    try:
        render = functools.partial(tokenizer.apply_chat_template, tools=[_PROBE_TOOL], tokenize=False)
        head, full = render(user, add_generation_prompt=True), render(user + [turn])
    except Exception:  # a template that refuses tools or tool calls has no format of its own
        return PLAIN
    if _NAME not in head or not full.startswith(head):
        return PLAIN
    for fmt in (HERMES, LLAMA3):
        try:
            if parse_tool_call(full[len(head) :], fmt) == (_NAME, {"x": _VALUE}):
                return fmt
        except ToolCallError:
            pass
    return PLAIN


def choose(tokenizer, want: str = "auto") -> CallFormat:
    """The run's call format: --env.tool-format `want` ('plain', or 'auto': the template's own)."""
    return PLAIN if want == "plain" else template_format(tokenizer)


def startup_line(fmt: CallFormat, forced_by: str = "") -> str:
    """The one start-up line that says how tools are offered and calls read; `forced_by`: the flag that asked
    for the plain format ('' when the template chose)."""
    if fmt.native:
        return (
            f"note: tool calls in the chat template's own format ({fmt.name}): the tools rendered by the template "
            f"(tools=), a call read as {fmt.form}, its result sent as a tool message"
        )
    why = forced_by or "the chat template renders no tools"
    return (
        f"note: tool calls in the plain format ({why}): the tool list in the first message, a call read as "
        f"{fmt.form}, its result sent as a tool message"
    )
