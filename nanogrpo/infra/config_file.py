"""A TrainConfig from JSON: a run's config.json (--resume) or a config file (--config), typed and checked
field by field, options of earlier versions renamed; and a config dict's dotted keys.

A saved config is rebuilt exactly or refused: a key this version does not know, or a value of the wrong
type, names the field and the fix, since the run it describes could not be reproduced. Settings that run the
user's own code are never read from a file (CODE_SETTINGS): the flag typed on the command line gives them.
"""

from __future__ import annotations

import json
import typing
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from nanogrpo.config import TrainConfig

# RewardConfig's fields that let a run import and call the user's Python: never read from a file
CODE_SETTINGS = ("allow_user_code", "style_allow_user_code")


def flag(path: str) -> str:
    """The command-line flag of a dotted config field: 'optim.warmup_steps' -> '--optim.warmup-steps'."""
    return "--" + path.replace("_", "-")


def from_dict(cls: type, d: dict, where: str, prefix: str = "", hint: str = "") -> Any:
    """Rebuild a (nested, frozen) config dataclass from its `asdict` JSON: lists become tuples again.

    A field the JSON lacks takes its default (a config saved before the field existed, or one written by
    hand with only the fields it changes); a key this version does not know is refused, naming it, since the
    run it describes cannot be reproduced, and so is a value of the wrong type (`hint`: what to do then)."""
    hint = hint or "resume with the version that wrote the run, or start a new run with another --out-dir"
    if not isinstance(d, dict):
        what = f"{prefix.rstrip('.')} must be" if prefix else "the config must be"
        raise ValueError(f"{where}: {what} a JSON object of options, not {json.dumps(d)}")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(
            f"{where}: {', '.join(prefix + k for k in unknown)} is not an option of this nanogrpo; {hint}"
        )
    kw = {}
    for name, value in d.items():
        t = hints[name]
        if is_dataclass(t):
            kw[name] = from_dict(t, value, where, f"{prefix}{name}.", hint)
        else:
            kw[name] = _value(t, value, f"{where}: {flag(prefix + name)}")
    return cls(**kw)


def _value(t: Any, value: Any, where: str) -> Any:
    """value as a field of type t takes it (a JSON list as a tuple, an int as a float), or ValueError."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(
                f"{where} is {json.dumps(value)}; one of {', '.join(json.dumps(a) for a in args)}"
            )
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} is {json.dumps(value)}; a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v, where) for v in value)
        if len(value) != len(args):
            raise ValueError(f"{where} is {json.dumps(value)}; a list of {len(args)}")
        return tuple(_value(a, v, where) for a, v in zip(args, value))
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = {bool: (bool,), int: (int,), float: (float,), str: (str,)}.get(t)
    if ok is not None and (not isinstance(value, ok) or (t is int and isinstance(value, bool))):
        raise ValueError(f"{where} is {json.dumps(value)}; a JSON {t.__name__}")
    return value  # a type this check does not know: as written


def read_config(path: str | Path, what: str, hint: str = "") -> TrainConfig:
    """The TrainConfig in a JSON file (a run's config.json, or one written by hand): `what` names the flag
    that asked for it, for the messages. Options of earlier nanogrpo versions are renamed first."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: {path} does not exist (or is not a file)")
    try:
        saved = json.loads(path.read_text())
    except RecursionError as e:  # a 100,000-deep array: Python's parser recurses
        raise ValueError(
            f"{path}: nested too deeply to be a config; {what} needs a TrainConfig as JSON"
        ) from e
    except ValueError as e:  # not JSON, not UTF-8, or a number past Python's 4,300-digit limit
        raise ValueError(f"{path}: not valid JSON ({e}); {what} needs a TrainConfig as JSON") from e
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: {what} needs a JSON object of options, not {type(saved).__name__}")
    cfg = from_dict(TrainConfig, renamed_options(saved, str(path)), str(path), hint=hint)
    # settings that run code are never taken from a file: a folder someone else made cannot run its own
    # Python through --resume or --config; the flag typed on the command line gives them (train.cli)
    return replace(cfg, reward=replace(cfg.reward, **dict.fromkeys(CODE_SETTINGS, False)))


def load_config(out_dir: str | Path) -> TrainConfig:
    """The TrainConfig a run saved in out_dir/config.json."""
    path = Path(out_dir) / "config.json"
    if not path.exists():
        raise ValueError(
            f"--resume: {path} does not exist, so there is no run to continue; "
            f"drop --resume to start one in {out_dir}, or name the run's folder with --out-dir"
        )
    return read_config(path, "--resume")


def pop_config_flag(argv: list[str]) -> str | None:
    """Take `--config FILE` (or `--config=FILE`) out of argv, in place: FILE, or None when not given."""
    found = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError("--config is given more than once: name one config file")
    i = found[0]
    if argv[i] != "--config":
        return argv.pop(i).split("=", 1)[1]
    if i + 1 == len(argv) or argv[i + 1].startswith("--"):
        raise ValueError("--config needs a file: --config RUN/config.json")
    del argv[i]
    return argv.pop(i)


def rerun_defaults(config: str | Path, preset: str | None) -> TrainConfig:
    """The defaults `--config FILE` gives a new run: FILE's config (a resumed run's too), not resuming; a
    preset named beside it is refused (both would set the defaults)."""
    if preset:
        raise ValueError(
            f"the preset '{preset}' and --config {config} both set the defaults: drop '{preset}' to rerun the "
            f"config (flags still override it), or drop --config to start from the preset"
        )
    hint = "remove or rename it (python train.py --help lists every option)"
    return replace(read_config(config, "--config", hint), resume=False)


def check_rerun_dir(config: str | Path, cfg: TrainConfig) -> None:
    """`--config FILE` starts a new run: refuse --resume, the folder FILE is in, and a folder that already
    holds a run (the out_dir FILE names, when no --out-dir is given), each with the flag that fixes it."""
    out, config = Path(cfg.out_dir), Path(config)
    if cfg.resume:
        raise ValueError(
            f"--config starts a new run from {config}, and --resume continues the run in {out}: drop --resume "
            f"(and pass a new --out-dir) to rerun the config, or drop --config to continue that run"
        )
    if out.resolve() == config.resolve().parent:
        raise ValueError(
            f"--config {config} starts a new run, and its --out-dir {out} is the folder that config is in: "
            f"pass another --out-dir for the new run (to continue that run instead: --out-dir {out} --resume)"
        )
    if (out / "metrics.jsonl").exists() or (out / "ckpt").exists():
        raise ValueError(
            f"--config {config} starts a new run, and --out-dir {out} (the config's, unless given) already "
            "holds a run: pass another --out-dir"
        )


def renamed_options(saved: dict, where: str) -> dict:
    """A config.json of an earlier nanogrpo in this version's terms: options since renamed, mapped to the
    setting that trains the same way (grpo.adv_std_norm true / false is grpo.scale_rewards 'group' / 'none')."""
    grpo = saved.get("grpo")
    if isinstance(grpo, dict) and "adv_std_norm" in grpo:
        grpo = dict(grpo)
        scale = "group" if grpo.pop("adv_std_norm") else "none"
        if grpo.setdefault("scale_rewards", scale) != scale:
            raise ValueError(
                f"{where}: grpo.adv_std_norm (an earlier name) and grpo.scale_rewards "
                f"{grpo['scale_rewards']!r} disagree; keep the one the run used"
            )
        saved = {**saved, "grpo": grpo}
    return saved


def flat_config(d: dict, prefix: str = "") -> dict[str, Any]:
    """A config dict (nested, as config.json holds it) as dotted keys: {"optim": {"lr": 1}} -> {"optim.lr": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out
