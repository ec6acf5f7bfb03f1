"""Tool calls in the model's own format and thinking templates (nanogrpo/envs/tool_calls.py, render.py, spec.py),
on the real chat templates TRL ships (tests/helpers.py reads them without importing trl) set on the tiny model's
tokenizer: a tool class's schemas, the call format read from each template, calls rendered by the template and
parsed back, a malformed call answered with its parse error, the tool message appended as the template's own
suffix, Qwen3's start-up line, and a whole episode in the Hermes format on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from env_examples import Vowels
from helpers import Scripted, template_tokenizer

from nanogrpo.config import EnvConfig, SamplingConfig
from nanogrpo.data import render_prompt
from nanogrpo.envs import protocol_attrs
from nanogrpo.envs.render import TurnFormat
from nanogrpo.envs.spec import THINKING_LINE, build_spec, check_start
from nanogrpo.envs.tool_calls import (
    FORMATS,
    HERMES,
    LLAMA3,
    PLAIN,
    ToolCallError,
    parse_tool_call,
    template_format,
)
from nanogrpo.envs.tools import tool_class_factory


class Weather:
    """A TRL-style tool class: two typed, documented tools; the reward is 1 once add returns the row's answer."""

    max_turns = 3

    def reset(self, **row):
        self.answer, self.reward = int(row.get("answer", 5)), 0.0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first number
            b: the second number
        """
        self.reward = float(a + b == self.answer)
        return a + b

    def lookup(self, city: str, days: int = 1, metric: bool = True) -> dict:
        """Look up the weather.

        Args:
            city: the city's name
            days: how many days ahead
            metric: degrees Celsius rather than Fahrenheit
        """
        return {"city": city, "days": days, "temp": 21.5 if metric else 70.7}


def weather_env(tool_format: str = "plain"):
    env = tool_class_factory(Weather)()
    env.tool_format = tool_format  # as the run sets it (envs/spec.py)
    env.reset({"prompt": "What is 2 + 3?", "answer": 5}, 0)
    return env


def test_a_tool_classs_methods_become_json_schema_tools() -> None:
    """Each public method is a tool in OpenAI's function format, from its signature and docstring; the instance
    declares them as `tools`, which the protocol's start-up check reads."""
    env = tool_class_factory(Weather)()
    tools = {t["function"]["name"]: t for t in env.tools}
    assert list(tools) == ["add", "lookup"] and all(t["type"] == "function" for t in env.tools)
    lookup = tools["lookup"]["function"]
    assert lookup["description"] == "Look up the weather."
    assert lookup["parameters"]["type"] == "object" and lookup["parameters"]["required"] == ["city"]
    assert lookup["parameters"]["properties"] == {
        "city": {"type": "string", "description": "the city's name"},
        "days": {"type": "integer", "description": "how many days ahead"},
        "metric": {"type": "boolean", "description": "degrees Celsius rather than Fahrenheit"},
    }
    assert tools["add"]["function"]["parameters"]["required"] == ["a", "b"]
    assert protocol_attrs(env)["tools"] == tuple(env.tools)


FAMILIES = [("qwen2_5", HERMES), ("qwen3", HERMES), ("llama3_2", LLAMA3), ("llama3_1", LLAMA3)]
ARGS = {"city": 'Zürich "old town"', "days": 3, "metric": False}


@pytest.mark.parametrize("name, fmt", FAMILIES, ids=[n for n, _ in FAMILIES])
def test_a_call_rendered_by_the_real_template_parses_back(name, fmt) -> None:
    """The format is read from the template; a call the template writes, decoded as the sampler decodes a turn,
    parses back to the same name and arguments."""
    tok = template_tokenizer(name)
    assert template_format(tok) == fmt
    tools, user = tool_class_factory(Weather)().tools, [{"role": "user", "content": "Weather in Zürich?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": ARGS}}]}  # fmt: skip
    head = tok.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(user + [call], tools=tools, tokenize=False)
    assert full.startswith(head) and "lookup" in head  # the template renders the tools
    turn = tok.decode(tok(full[len(head) :], add_special_tokens=False)["input_ids"], skip_special_tokens=True)
    assert parse_tool_call(turn, fmt) == ("lookup", ARGS)
    assert parse_tool_call(fmt.write("lookup", ARGS), fmt) == ("lookup", ARGS)
    assert parse_tool_call("It is sunny.", fmt) is None  # an answer holds no call
    thought = f"<think>Maybe {fmt.write('lookup', ARGS)}? No.</think>\n\nIt is sunny."
    assert parse_tool_call(thought, fmt) is None  # a call in the thinking is not made


def test_a_template_without_tools_gets_the_plain_format(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # ChatML without tools, as SmolLM2's
    assert template_format(tok) == PLAIN
    assert parse_tool_call("Let me look. " + PLAIN.write("lookup", ARGS), PLAIN) == ("lookup", ARGS)


@pytest.mark.parametrize("fmt", ["plain", "hermes", "llama3"])
def test_a_malformed_call_is_an_invalid_action_whose_observation_is_the_parse_error(fmt) -> None:
    bad = {
        "plain": '<tool>{"name": "add", "arguments": {"a": 2,}}</tool>',
        "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>',
        "llama3": '{"name": "add", "parameters": {"a": 2,}}',
    }[fmt]
    step = weather_env(fmt).step(bad)
    why = step.info["tool_parse_error"]
    assert why.startswith("the tool call is not JSON (Expecting property name")
    assert why.endswith(FORMATS[fmt].form)  # what was wrong, and the form expected
    assert json.loads(step.observation) == {"error": why}
    assert step.info["invalid"] and step.info["tool_calls"] == 0 and not step.done
    ok = weather_env(fmt).step(FORMATS[fmt].write("add", {"a": 2, "b": 3}))
    assert (ok.observation, ok.reward, ok.done) == ("5", 1.0, False)
    assert ok.info == {"tool": "add", "tool_calls": 1}
    if FORMATS[fmt].close:  # a call cut before its closing tag (the turn's budget ran out)
        with pytest.raises(ToolCallError, match=f"no closing {FORMATS[fmt].close}; write the call as"):
            parse_tool_call(bad[:20], FORMATS[fmt])


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "llama3_2"])
def test_a_tool_message_is_the_templates_suffix(name) -> None:
    """Prefix-preserving: the prompt rendered with tools=, the call's tokens as sampled, and the observation's
    tokens are, together, the template's rendering of the conversation with the tool message (a result with
    quotes and a line break, which Llama 3's template writes as JSON)."""
    tok = template_tokenizer(name)
    fmt, tools = template_format(tok), tool_class_factory(Weather)().tools
    result = '{"temp": 21.5}\nsunny, "mostly"'
    user = [{"role": "user", "content": "Weather in Zürich?"}]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"city": "Zürich"}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    msgs = [*user, turn, {"role": "tool", "content": result}]
    want = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    prompt = render_prompt(tok, {"prompt": "Weather in Zürich?"}, tools=tools)
    head = tok.decode(prompt)
    on_eos = not fmt.close  # Hermes stops on </tool_call>, Llama 3 on its end of turn
    end = (
        want.index(tok.eos_token, len(head)) if on_eos else want.index(fmt.close, len(head)) + len(fmt.close)
    )
    sampled = tok(want[len(head) : end], add_special_tokens=False)["input_ids"]  # the call, as sampled
    sampled += [tok.eos_token_id] if on_eos else []
    obs = TurnFormat.of(tok, "tool", tools=tools).observation_ids(tok, result, on_eos)
    assert tok.decode(prompt + sampled + obs) == want
    assert prompt + sampled + obs == tok(want, add_special_tokens=False)["input_ids"]


def test_qwen3s_template_starts_with_its_one_line(capsys) -> None:
    """Qwen3's template drops earlier <think> blocks once a user message follows: the start-up check's made-up
    conversation holds one, and the run starts with the line that says what keeping the sampled thinking
    means; the observation follows the sampled EOS without a second one."""
    tok = template_tokenizer("qwen3")
    env = build_spec(Vowels, "Vowels", EnvConfig(spec="x.py:Vowels"), 16)
    rows = [{"prompt": "hi", "_prompt_ids": render_prompt(tok, {"prompt": "hi"})}]
    env = check_start(env, tok, rows, "", 400, 1024, 1)
    env.workers.close()
    out = capsys.readouterr().out
    assert out.count(THINKING_LINE) == 1 and "deployment that re-renders the history" in THINKING_LINE
    assert env.turns.thinking == "drops"
    after_eos = "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"  # no second <|im_end|>
    assert env.turns.observation_text("go on", True) == after_eos
    assert TurnFormat.of(tok, "tool").thinking == ""  # a tool result is no new query: Qwen3 keeps thinking
    assert TurnFormat.of(template_tokenizer("qwen2_5"), "user").thinking == ""


TOOL_MESSAGE = (
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def test_an_episode_in_the_hermes_format_end_to_end(monkeypatch, capsys, tiny_model_dir) -> None:
    """The tiny model with Qwen2.5's template: the run picks the Hermes format (one line), the first prompt
    carries the tools, a call sampled in that format is run and its result appended as the template's tool
    message at mask 0, and the trajectory is token for token the template's rendering of the conversation."""
    from nanogrpo.envs import episode
    from nanogrpo.model.transformer import Transformer

    tok = template_tokenizer("qwen2_5", tokens=False)  # the tiny model's 1,024 ids: no token added
    model = Transformer.from_pretrained(tiny_model_dir).eval()
    cfg = EnvConfig(spec="x.py:Weather", max_tokens=120)  # the tools fill 853 of the 1,024 positions
    rows = [{"prompt": "What is 2 + 3?", "answer": 5}]
    rows[0]["_prompt_ids"] = render_prompt(tok, rows[0])
    env = build_spec(tool_class_factory(Weather), "Weather", cfg, 48)
    env = check_start(env, tok, rows, "", 900, 1024, 2)
    assert "tool calls in the chat template's own format (hermes)" in capsys.readouterr().out
    assert env.stop == ("</tool_call>",) and env.calls == "hermes"
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    Scripted.turns = [tok(call)["input_ids"], tok("It is 5.")["input_ids"] + [tok.eos_token_id]]
    monkeypatch.setattr(episode, "Sampler", Scripted.make(episode.Sampler))
    with torch.no_grad():
        trajs = episode.play(model, tok, env, rows, [7], SamplingConfig(max_new_tokens=48), 2, system_prompt="",
                             eos_ids=(tok.eos_token_id,), pad_id=0)  # fmt: skip
    env.workers.close()
    tools = tool_class_factory(Weather)().tools
    assert all(t.prompt_ids == render_prompt(tok, rows[0], tools=tools) for t in trajs)  # tools= rendered
    assert "<tools>" in tok.decode(trajs[0].prompt_ids) and "You can call" not in trajs[0].prompt
    msgs = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]  # fmt: skip
    want = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    want = want.removesuffix("\n")  # the template's text after the last EOS: not sampled
    for t in trajs:
        assert tok.decode(t.prompt_ids + t.ids) == want
        assert t.prompt_ids + t.ids == tok(want, add_special_tokens=False)["input_ids"]
        n1, n2 = len(Scripted.turns[0]), len(Scripted.turns[1])
        obs = t.ids[n1 : len(t.ids) - n2]
        assert t.mask == [1.0] * n1 + [0.0] * len(obs) + [1.0] * n2  # the tool message at mask 0
        assert t.logp[n1 : n1 + len(obs)] == [0.0] * len(obs)
        assert tok.decode(obs) == TOOL_MESSAGE
        assert [x["role"] for x in t.turns] == ["assistant", "tool", "assistant"]
        assert t.turns[1]["content"] == "5"
        assert t.reward == 1.0 and t.done and t.info == {"tool_calls": 0}


def test_gemma3s_template_joins_an_episodes_turns_as_it_renders_them() -> None:
    """Gemma 3's template (TRL's copy): no tool calls of its own (the plain format), and an episode's user
    observation after a turn that ended on its end-of-turn token is the template's own rendering of the
    conversation, token for token, so a trajectory's tokens are the template's."""
    tok = template_tokenizer("gemma3")
    assert template_format(tok) == PLAIN
    fmt, reply, obs = TurnFormat.of(tok, "user"), "My guess is 42.", "Higher."
    user = [{"role": "user", "content": "Guess my number."}]
    msgs = [*user, {"role": "assistant", "content": reply}, {"role": "user", "content": obs}]
    want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    prompt = render_prompt(tok, {"prompt": "Guess my number."})
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    sampled = tok(reply, add_special_tokens=False)["input_ids"] + [end]  # the turn, ended on <end_of_turn>
    obs_ids = fmt.observation_ids(tok, obs, "<end_of_turn>")  # the EOS it ended on: not the tokenizer's <eos>
    assert tok.decode(prompt + sampled + obs_ids) == want
    assert tok.decode(fmt.observation_ids(tok, obs, True)).count("<end_of_turn>") == 2  # <eos> is not it


@pytest.mark.parametrize(
    "name", ["qwen3_5_think", "qwen3_5_think_training", "qwen3_5_nothink", "qwen3_5_nothink_training"]
)
def test_qwen35s_templates_join_an_episodes_turns_as_they_render_them(name) -> None:
    """Qwen3.5's templates (TRL's copies) write the start of the reply into the prompt: a thinking one opens the
    <think> block (the model samples the rest of it), a non-thinking one writes an empty block. An episode's
    user observation after a sampled turn is then the template's rendering of the conversation whose assistant
    message is that opening and the sampled text: token for token where the template keeps earlier turns (the
    training templates), and from the reply's answer on where it drops their thinking (the others, said at
    start-up as for Qwen3)."""
    tok = template_tokenizer(name)
    fmt, answer, obs = TurnFormat.of(tok, "user"), "My guess is 42.", "Higher."
    thinks = "nothink" not in name
    reply = f"Halfway is 50.\n</think>\n\n{answer}" if thinks else answer  # what the model samples
    prompt = render_prompt(tok, {"prompt": "Guess my number."})
    sampled = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ours = prompt + sampled + fmt.observation_ids(tok, obs, True)
    content = f"<think>\n{reply}" if thinks else reply  # the message: the prompt's opening and the reply
    msgs = [{"role": "user", "content": "Guess my number."}, {"role": "assistant", "content": content}]
    want = tok.apply_chat_template(
        [*msgs, {"role": "user", "content": obs}], tokenize=False, add_generation_prompt=True
    )
    assert fmt.opening == ("<think>\n" if thinks else "")  # a turn's message starts with it
    if thinks:  # a call the turn stops at before closing the thinking is thought, not made
        with pytest.raises(ToolCallError, match="inside a <think> block"):
            parse_tool_call(fmt.opening + 'Let me call <tool_call>{"name": "f"}</tool_call>', HERMES)
    if "training" in name:
        assert fmt.thinking == "" and ours == tok(want, add_special_tokens=False)["input_ids"]
    else:
        assert fmt.thinking == "drops" and tok.decode(ours).endswith(want[want.index(answer) :])
        assert tok.decode(ours).startswith(tok.decode(prompt) + reply)


def test_a_template_that_refuses_a_tool_message_is_one_line() -> None:
    """Gemma 3's template has no tool role (it raises 'roles must alternate'): refused with the way out."""
    with pytest.raises(ValueError, match="cannot write a 'tool' message.*alternate.*--env.format plain"):
        TurnFormat.of(template_tokenizer("gemma3"), "tool")
