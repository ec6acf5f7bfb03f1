"""Which training run wrote a completions file, and the warning when it is judged by what trained it.

`eval.py generate` records how it made FILE in FILE.meta.json (`write_meta`), with the training run of its
adapter; train.py's eval files say which model wrote them too (evaluate.py `save_eval`). score, compare
and elo then read that run's config.json and warn when a grader or judge model of the evaluation also
trained the policy (`same_judge_warning`): the policy learned that judge's blind spots, so grading it with
the same judge counts them as gains twice. An environment's own outcome (the `env` grader: the game's result)
is no judge, and is not warned about.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rewards.episode import OUTCOMES
from rewards.spec import parse_spec


def meta_path(path: str | Path) -> Path:
    """Where `eval.py generate` records how FILE was made: FILE.meta.json (also for FILE.scored.jsonl)."""
    p = Path(path)
    return p.with_name(p.name.removesuffix(".jsonl").removesuffix(".scored") + ".meta.json")


def adapter_run(adapter: str | Path) -> Path | None:
    """The run folder an adapter was trained in: the nearest of its parents (runs/x/adapter, or a checkpoint
    runs/x/ckpt/step_000080) that holds a run's config.json; None for a base model or an adapter elsewhere."""
    if not adapter:
        return None
    for parent in list(Path(adapter).resolve().parents)[:3]:
        if (parent / "config.json").is_file() and "reward" in _read_json(parent / "config.json"):
            return parent
    return None


def write_meta(out: str | Path, **fields: Any) -> Path:
    """FILE.meta.json beside a completions file: the settings that made it, and `run`, the training run of
    its adapter relative to the file's folder (None: no adapter, or one from no run folder)."""
    run = adapter_run(fields.get("adapter") or "")
    path = meta_path(out)
    if path.is_dir():  # generate writes this after the completions, so the line says they are safe
        raise ValueError(
            f"{path} is a folder: remove or rename it, so that how {out} was made can be recorded there, or "
            f"generate to another --out ({out} itself is written)"
        )
    rel = None if run is None else os.path.relpath(run, path.parent.resolve())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**fields, "run": rel}, indent=2) + "\n")
    except OSError as e:  # a full disk, say
        raise ValueError(f"cannot write {path} ({e.strerror or e}); {out} itself is written") from None
    return path


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def run_of(path: str | Path) -> Path | None:
    """The training run whose model wrote a completions file: the `run` in FILE.meta.json when there is one
    (None for the base model), else the file's own folder when it is a run folder (holds config.json)."""
    meta = meta_path(path)
    if meta.is_file():  # a folder of that name is no record: the file's own folder decides
        run = _read_json(meta).get("run")
        # a `run` that is no path (a hand-edited or foreign file) names no run, as a damaged file does
        return (meta.parent / run).resolve() if isinstance(run, str) and run else None
    folder = Path(path).resolve().parent
    return folder if "reward" in _read_json(folder / "config.json") else None


def _model_key(name: str) -> str:
    """A judge model's name to compare: 'openai:Org/Model-7B' and a local 'models/model-7b/' agree."""
    return name.strip().rstrip("/").split("/")[-1].lower()


def _uses_judge(grader: str, rubric_readout: str) -> bool:
    """Does this grader ask --reward.judge.model? The judge family (judge, judge+similarity, judge_entropy,
    ...) does, and so does rubric unless its readout is a probe."""
    return grader.startswith("judge") or (grader == "rubric" and rubric_readout != "probe")


def trained_with(reward: dict) -> tuple[set[str], dict[str, str]]:
    """(graders with a weight > 0, {judge model key: model}) of a run's config.json `reward` section."""
    graders = {n for n, w in parse_spec(reward.get("spec", "")) if w > 0} if reward.get("spec") else set()
    readout = (reward.get("rubric") or {}).get("readout", "generative")
    models = {}
    model = (reward.get("judge") or {}).get("model", "")
    if model and any(_uses_judge(g, readout) for g in graders):
        models[_model_key(model)] = model
    probe = (reward.get("rubric") or {}).get("probe", "")
    if probe and "rubric" in graders and readout == "probe":
        models[_model_key(probe)] = probe
    return graders, models


def grader_names(spec: str) -> list[str]:
    """'rouge_l,judge:0.5' -> ['rouge_l', 'judge']; '' -> []."""
    return [n for n, _ in parse_spec(spec, "--graders")] if spec.strip() else []


def eval_judges(graders: Sequence[str], reward_cfg: Any = None) -> list[str]:
    """The judge models behind these graders under `reward_cfg` (a RewardConfig): its judge model when a
    grader asks one, its rubric probe when rubric reads one."""
    if reward_cfg is None:
        return []
    readout, out = reward_cfg.rubric.readout, []
    if reward_cfg.judge.model and any(_uses_judge(g, readout) for g in graders):
        out.append(reward_cfg.judge.model)
    if reward_cfg.rubric.probe and "rubric" in graders and readout == "probe":
        out.append(reward_cfg.rubric.probe)
    return out


def same_judge_warning(
    path: str | Path, graders: Sequence[str] = (), judge_models: Sequence[str] = ()
) -> str | None:
    """One warning line when FILE's run was trained with one of these graders or judge models, else None.

    A policy trained against a grader learns that grader's blind spots; grading it with the same grader
    counts them as gains a second time (the graders guide's common mistake), so the gain is inflated. An
    environment's own outcome (the env, turns and valid graders: rewards.episode.OUTCOMES) is the game's result,
    not a judge, and is never warned about.
    """
    run = run_of(path)
    if run is None:
        return None
    reward = _read_json(run / "config.json").get("reward") or {}
    trained, models = trained_with(reward)
    same = [f"grader {g}" for g in dict.fromkeys(graders) if g in trained and g not in OUTCOMES]
    same += [f"judge model {models[k]}" for k in dict.fromkeys(map(_model_key, judge_models)) if k in models]
    if not same:
        return None
    return (
        f"warning: {path} is judged by {', '.join(same)}, which also trained it ({run / 'config.json'}, "
        f"reward.spec '{reward.get('spec')}'): the policy learned this judge's blind spots, so they count as "
        "gains twice and the result is inflated; judge it with a grader or judge model it was not trained on"
    )


def warn_same_judge(paths: Sequence[str], graders: Sequence[str], judge_models: Sequence[str]) -> None:
    """One warning line on stderr per training run that is judged by a grader or judge model it trained on."""
    warned = set()
    for path in paths:
        run = run_of(path)
        msg = same_judge_warning(path, graders, judge_models) if run not in warned else None
        if msg:
            print(msg, file=sys.stderr)
            warned.add(run)
