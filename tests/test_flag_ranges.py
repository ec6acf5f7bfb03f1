"""Every numeric flag has a declared range, checked in one place (nanogrpo_base/ranges.py's check_ranges): a
dataclass's ranges sit on its fields (`Annotated[int, at_least(1)]`), a command without one (a function, an
argparse parser) has a table (nanogrpo/infra/flag_checks.py, rewards/probe_cli.py). The walk below finds every
numeric field of every command (train.py's TrainConfig, eval.py's subcommands, each `python -m nanogrpo.*` /
`rewards.*` command's dataclass, function or argparse parser), fails on one without a range, and tries a value
just outside each; the end-to-end rows run the commands themselves: exit 2, one line naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
from helpers import _in_process, run_eval, run_train_here, write_rows

import eval as eval_py
from nanogrpo.config import TrainConfig
from nanogrpo.eval import probe as nanogrpo_probe
from nanogrpo.eval import readouts
from nanogrpo.infra import flag_checks
from nanogrpo.infra.flag_checks import check_config
from nanogrpo.lab import ablate, klcheck, ppo_vs_grpo, rlvrr
from nanogrpo.recipes.presets import PRESETS
from nanogrpo.reward_data import __main__ as reward_data_main
from nanogrpo.reward_data import convert
from nanogrpo_base.ranges import FlagRangeError, Range, check_ranges, field_ranges, flag_name
from rewards import grade, probe_cli

ROOT = Path(__file__).resolve().parents[1]


def parser_of(main, argv: list[str]) -> argparse.ArgumentParser:
    """The argparse parser `main(argv)` builds (it is stopped at parse_args)."""
    seen = []

    class Parsed(Exception):
        pass

    def stop(self, *a, **k):
        seen.append(self)
        raise Parsed

    real = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = stop
    try:
        main(argv)
    except Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_args = real
    return seen[0]


# (command, what its flags are: a dataclass, a function or an argparse parser, its ranges, its source file);
# a dataclass's ranges are read from its fields, the others' are their command's table
COMMANDS = [
    ("train.py", TrainConfig, field_ranges(TrainConfig), "train.py"),
    ("lab.research run", TrainConfig, field_ranges(TrainConfig), "nanogrpo/lab/research.py"),  # train.py's
    *[(f"eval.py {n}", c, field_ranges(c), "eval.py") for n, c in eval_py.COMMANDS.items()],
    ("rewards.grade", grade.GradeArgs, field_ranges(grade.GradeArgs), "rewards/grade.py"),
    ("probe train", probe_cli.train, probe_cli.PROBE_TRAIN, "rewards/probe_cli.py"),
    ("probe eval", probe_cli.eval, probe_cli.PROBE_EVAL, "rewards/probe_cli.py"),
    ("probe compare", readouts.compare, flag_checks.PROBE_COMPARE, "nanogrpo/eval/probe.py"),
    ("lab.rlvrr", rlvrr.TableArgs, field_ranges(rlvrr.TableArgs), "nanogrpo/lab/rlvrr.py"),
    *[
        (f"reward_data {n}", c, field_ranges(c), "nanogrpo/reward_data/__main__.py")
        for n, (c, _) in reward_data_main.COMMANDS.items()
    ],
    *[
        (f"convert {n}", c, field_ranges(c), "nanogrpo/reward_data/convert.py")
        for n, c in convert.COMMANDS.items()
    ],
    ("lab.ablate", parser_of(ablate.main, ["toy"]), flag_checks.LAB["ablate"], "nanogrpo/lab/ablate.py"),
    ("lab.klcheck", parser_of(klcheck.main, []), flag_checks.LAB["klcheck"], "nanogrpo/lab/klcheck.py"),
    (
        "lab.ppo_vs_grpo",
        parser_of(ppo_vs_grpo.main, []),
        flag_checks.LAB["ppo_vs_grpo"],
        "nanogrpo/lab/ppo_vs_grpo.py",
    ),
]
IDS = [c[0] for c in COMMANDS]


def _number_type(t) -> tuple[type, bool] | None:
    """(int or float, is a tuple) for a numeric annotation (Optional and Annotated unwrapped), else None."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return _number_type(args[0]) if len(args) == 1 else None
    if typing.get_origin(t) in (tuple, list) and args and args[0] in (int, float):
        return args[0], True
    return (t, False) if t in (int, float) else None


def numeric_fields(target, prefix: str = "") -> dict[str, tuple[type, bool]]:
    """{dotted path: (int or float, is a tuple)} of every numeric flag of a command."""
    if isinstance(target, argparse.ArgumentParser):
        return {
            prefix + a.dest: (a.type, a.nargs not in (None, "?"))
            for a in target._actions
            if a.type in (int, float)
        }
    hints = typing.get_type_hints(target)
    names = (
        [f.name for f in dataclasses.fields(target)]
        if dataclasses.is_dataclass(target)
        else list(inspect.signature(target).parameters)
    )
    out = {}
    for name in names:
        t = hints[name]
        if dataclasses.is_dataclass(t):
            out.update(numeric_fields(t, f"{prefix}{name}."))
        elif (kind := _number_type(t)) is not None:
            out[prefix + name] = kind
    return out


def at_defaults(cls):
    """A dataclass command's flags at their defaults (required strings filled in)."""
    fill = {
        f.name: "x" for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING
    }
    return cls(**fill)


def replaced(obj, path: str, value):
    """`obj` with the field at dotted `path` (nested dataclasses included) set to `value`."""
    name, _, rest = path.partition(".")
    return dataclasses.replace(obj, **{name: replaced(getattr(obj, name), rest, value) if rest else value})


def defaults(target) -> dict:
    """The command's flags at their defaults, as a dict of dotted paths (required strings filled in)."""
    if isinstance(target, argparse.ArgumentParser):
        return {a.dest: a.default for a in target._actions if a.dest != "help"}
    if dataclasses.is_dataclass(target):
        return flat(at_defaults(target))
    params = inspect.signature(target).parameters.values()
    return {p.name: "x" if p.default is inspect.Parameter.empty else p.default for p in params}


def flat(obj, prefix: str = "") -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out.update(flat(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else {prefix + f.name: v})
    return out


def just_outside(r: Range, kind: type) -> list[float]:
    """Values just outside `r` (each bound, and NaN for a float); none for an int of ANY."""
    out: list[float] = [math.nan, math.inf] if kind is float else []
    step = (lambda v, d: v + d) if kind is int else (lambda v, d: math.nextafter(v, d * math.inf))
    if r.lo is not None:
        out.append(r.lo if r.lo_open else step(r.lo, -1))
    if r.hi is not None:
        out.append(r.hi if r.hi_open else step(r.hi, 1))
    return [kind(v) if kind is int else v for v in out if v != r.also]


@pytest.mark.parametrize("command, target, table, source", COMMANDS, ids=IDS)
def test_every_numeric_flag_has_a_range_and_a_value_outside_it_is_refused(command, target, table, source):
    fields = numeric_fields(target)
    missing = [flag_name(p) for p in fields if p not in table]
    assert not missing, f"{command}: these numeric flags have no declared range: {missing}"
    assert not set(table) - set(fields), (
        f"{command}: ranges of flags it does not have: {set(table) - set(fields)}"
    )
    base = defaults(target)
    check_ranges(base, table)  # the defaults pass
    parsed = at_defaults(target) if dataclasses.is_dataclass(target) else None
    if parsed is not None:
        check_ranges(parsed)  # as the command checks them: the ranges read from the fields
    for path, (kind, is_tuple) in fields.items():
        for v in just_outside(table[path], kind):
            value = (v, v) if is_tuple else v
            with pytest.raises(FlagRangeError) as e:
                check_ranges({**base, path: value}, table)
            assert str(e.value).startswith(flag_name(path) + " "), (command, path, v, str(e.value))
            assert "must be" in str(e.value) and "\n" not in str(e.value)
            if parsed is not None:
                with pytest.raises(FlagRangeError, match="^" + re.escape(flag_name(path)) + " "):
                    check_ranges(replaced(parsed, path, value))


def test_every_numeric_flag_of_train_py_carries_its_range_on_its_field():
    """A new flag is one edit: its Range sits on its field as `Annotated` metadata (nested sections
    included), and check_config holds the number to it."""

    def walk(cls, prefix=""):
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            bare = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
            if dataclasses.is_dataclass(bare):
                yield from walk(bare, f"{prefix}{f.name}.")
            elif _number_type(bare) is not None:
                yield prefix + f.name, [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Range)]

    found = dict(walk(TrainConfig))
    assert len(found) > 70, len(found)
    assert {"steps", "lora.r", "optim.betas", "reward.judge.timeout_s", "env.step_timeout_s"} <= set(found)
    assert {p: len(r) for p, r in found.items() if len(r) != 1} == {}, "each numeric field: one Range"
    assert set(found) == set(numeric_fields(TrainConfig))
    cfg = PRESETS["tiny"][1]
    for path, (kind, is_tuple) in numeric_fields(TrainConfig).items():  # check_config reads those Ranges
        for v in just_outside(found[path][0], kind):
            with pytest.raises(FlagRangeError, match="^" + re.escape(flag_name(path)) + " "):
                check_config(replaced(cfg, path, (v, v) if is_tuple else v))


@dataclasses.dataclass(frozen=True)
class _Knobs:
    new_knob: int = 3


@dataclasses.dataclass(frozen=True)
class _Command:
    grpo: _Knobs = dataclasses.field(default_factory=_Knobs)


def test_a_number_without_a_range_is_a_bug_not_a_pass():
    assert numeric_fields(_Command) == {"grpo.new_knob": (int, False)}  # the walk finds it
    with pytest.raises(LookupError, match="--grpo.new-knob has no declared range: annotate its field"):
        check_ranges(_Command())  # and a command running with it stops
    with pytest.raises(LookupError, match="--new-knob has no declared range: add 'new_knob' to its"):
        check_ranges({"new_knob": 3}, {})  # a command with a table: the same


def test_every_command_line_in_the_library_is_walked():
    """A new `python -m` command (tyro or argparse) must join COMMANDS, so that its flags get ranges."""
    found = set()
    for path in [
        ROOT / "eval.py",
        ROOT / "train.py",
        *(ROOT / "nanogrpo").rglob("*.py"),
        *(ROOT / "nanogrpo_base").rglob("*.py"),
        *(ROOT / "rewards").rglob("*.py"),
    ]:
        text = path.read_text()
        if any(s in text for s in ("tyro.cli(", "subcommand_cli_from_dict(", "ArgumentParser(")):
            found.add(path.relative_to(ROOT).as_posix())
    walked = {c[3] for c in COMMANDS}
    assert found <= walked, f"commands whose flags are not walked: {sorted(found - walked)}"


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_passes_the_checks(name):
    check_config(PRESETS[name][1])


def test_the_message_names_the_flag_the_value_the_range_and_the_boundary():
    cfg = PRESETS["tiny"][1]
    cases = [
        (dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, r=-1)), "--lora.r -1: must be >= 0 (0 = full fine-tune)"),
        (dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, eps_low=5.0)), "--grpo.eps-low 5: must be in [0, 1]"),
        (dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, betas=(0.9, 1.0))), "--optim.betas 0.9 1: each must be in [0, 1)"),
        (dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=math.nan)), "--optim.lr nan: must be a finite number > 0"),
        (dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, dual_clip=0.5)), "--grpo.dual-clip 0.5: must be > 1, or 0"),
    ]  # fmt: skip
    for c, want in cases:
        with pytest.raises(ValueError) as e:
            check_config(c)
        assert str(e.value).startswith(want), str(e.value)


# ----------------------------------------------------------------------------- end to end: exit 2, one line


def one_line(r, flag: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} "), r.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(
    "flags, want",
    [
        (["--lora.r", "-1"], "--lora.r -1: must be >= 0 (0 = full fine-tune)"),
        (["--steps", "-1"], "--steps -1: must be >= 1"),
        (["--micro-batch", "-1"], "--micro-batch -1: must be >= 0 (0 = all at once)"),
        (["--grpo.eps-low", "5"], "--grpo.eps-low 5: must be in [0, 1]"),
        (["--prompts-per-step", "0"], "--prompts-per-step 0: must be >= 1"),
        (["--reward.judge.concurrency", "0"], "--reward.judge.concurrency 0: must be >= 1"),
    ],
)
def test_train_py_refuses_a_number_out_of_range_in_one_line(tmp_path, flags, want):
    r = run_train_here("tiny", "--out-dir", str(tmp_path / "run"), *flags)
    assert one_line(r, flags[0]).startswith(f"error: {want}")
    assert issubclass(FlagRangeError, ValueError)  # train.py's run prints it as one line, exit 2
    assert not (tmp_path / "run").exists()  # refused before the run folder, and the model


def _labels(tmp_path: Path) -> Path:
    return write_rows(tmp_path / "labels.jsonl", [{"text": f"t {i}", "label": i % 2} for i in range(4)])


def _completions(tmp_path: Path) -> Path:
    return write_rows(tmp_path / "c.jsonl", [{"id": 1, "prompt": "p", "reference": "a", "completion": "a"}])


def _convert(argv):
    """`python -m nanogrpo.reward_data.convert ARGV` (its command line is its `__main__` block)."""
    cmd = [sys.executable, "-m", "nanogrpo.reward_data.convert", *argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    print(r.stdout, end="")
    print(r.stderr, end="", file=sys.stderr)
    return r.returncode


SIDE = [  # (command, its run(argv), argv with one number out of range, the flag)
    ("eval score", eval_py.run, ["score", "{c}", "--resamples", "0"], "--resamples"),
    ("eval generate", eval_py.run, ["generate", "--data", "demo", "--batch-size", "0"], "--batch-size"),
    ("eval compare", eval_py.run, ["compare", "{c}", "{c}", "--resamples", "0"], "--resamples"),
    ("eval elo", eval_py.run, ["elo", "{c}", "{c}", "--server.concurrency", "0"], "--server.concurrency"),
    ("eval grade", eval_py.run, ["grade", "--data", "{c}", "--batch-size", "0"], "--batch-size"),
    ("eval report", eval_py.run, ["report", "{d}", "--max-sample-steps", "1"], "--max-sample-steps"),
    ("eval seeds", eval_py.run, ["seeds", "--out", "{d}/s", "--resamples", "0"], "--resamples"),
    ("eval seeds-table", eval_py.run, ["seeds-table", "{d}", "--seeds", "-1"], "--seeds"),
    ("rewards.grade", grade.main, ["--data", "{c}", "--reward.max-empty-steps", "-1"], "--reward.max-empty-steps"),
    ("rlvrr steps", rlvrr.main, ["--out", "{d}/t", "--steps", "-1"], "--steps"),
    ("rlvrr threads", rlvrr.main, ["--out", "{d}/t", "--threads", "0"], "--threads"),
    ("probe l2", nanogrpo_probe.main, ["train", "--data", "{l}", "--model", "tiny", "--out", "{d}/p", "--l2", "-1"], "--l2"),
    ("probe l2 nan", nanogrpo_probe.main, ["train", "--data", "{l}", "--model", "tiny", "--out", "{d}/p", "--l2", "nan"], "--l2"),
    ("probe max-len", nanogrpo_probe.main, ["train", "--data", "{l}", "--model", "tiny", "--out", "{d}/p", "--max-len", "0"], "--max-len"),
    ("probe batch-size", nanogrpo_probe.main, ["train", "--data", "{l}", "--model", "tiny", "--out", "{d}/p", "--batch-size", "0"], "--batch-size"),
    ("probe dev-frac 0", nanogrpo_probe.main, ["train", "--data", "{l}", "--model", "tiny", "--out", "{d}/p", "--dev-frac", "0"], "--dev-frac"),
    ("probe dev-frac 1", nanogrpo_probe.main, ["train", "--data", "{l}", "--model", "tiny", "--out", "{d}/p", "--dev-frac", "1"], "--dev-frac"),
    ("probe eval", nanogrpo_probe.main, ["eval", "--data", "{l}", "--probe", "{d}", "--batch-size", "0"], "--batch-size"),
    ("probe compare", nanogrpo_probe.main, ["compare", "--data", "{l}", "--model", "tiny", "--out", "{d}/r", "--folds", "1"], "--folds"),
    ("reward_data", reward_data_main.main, ["baseline", "{c}", "--out", "{d}/b.jsonl", "--share", "0"], "--share"),
    ("convert", _convert, ["split", "{c}", "--by", "id", "--out-dir", "{d}/s", "--ratios", "0.5", "1.5"], "--ratios"),
    ("lab.ablate", ablate.main, ["toy", "--steps", "0"], "--steps"),
    ("lab.klcheck", klcheck.main, ["--group", "4"], "--group"),
    ("lab.ppo_vs_grpo", ppo_vs_grpo.main, ["--out", "{d}/v", "--threads", "0"], "--threads"),
]  # fmt: skip


@pytest.mark.parametrize("command, run, argv, flag", SIDE, ids=[s[0] for s in SIDE])
def test_side_commands_refuse_a_number_out_of_range_in_one_line(tmp_path, command, run, argv, flag):
    work = tmp_path / "work"
    work.mkdir()
    names = {"{c}": str(_completions(tmp_path)), "{l}": str(_labels(tmp_path)), "{d}": str(work)}
    argv = [next((a.replace(k, v) for k, v in names.items() if k in a), a) for a in argv]
    r = run_eval(*argv, cwd=tmp_path) if run is eval_py.run else _in_process(run, command, argv, tmp_path)
    one_line(r, flag)
    assert list(work.iterdir()) == [], "nothing written"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["work", "c.jsonl", "labels.jsonl"])
