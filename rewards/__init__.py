"""nanogrpo's graders: reference-based rewards, one module per family, registered by name.

    from rewards import RewardConfig, Sample, build_reward
    reward = build_reward(RewardConfig(spec="rouge_l:0.7,numbers:0.3"))
    reward.validate(rows, "train.jsonl")              # refuses data a grader cannot read
    rewards, components = reward([Sample(prompt, completion, group, row), ...])

Importing the package imports every module in it, so a module's `@register("name")` is all it takes
to add a grader (see docs/GRADERS.md).
"""

import importlib
import pkgutil

from rewards.base import Grader, Sample
from rewards.options import RewardConfig
from rewards.registry import (
    Mix,
    NoRewardError,
    RewardFunction,
    build_reward,
    known,
    make,
    mean_metrics,
    mix,
    register,
)

# `grade` and `probe` are command lines (python -m rewards.grade, python -m rewards.probe): importing them
# here would make -m warn; probe_cli is its command line's parser
_NOT_GRADERS = {"base", "diagnostics", "options", "registry", "grade", "text", "probe", "probe_cli"}
for _m in pkgutil.iter_modules(__path__):
    if _m.name not in _NOT_GRADERS and not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = [
    "Grader",
    "Mix",
    "NoRewardError",
    "RewardConfig",
    "RewardFunction",
    "Sample",
    "build_reward",
    "known",
    "make",
    "mean_metrics",
    "mix",
    "register",
]
