"""Reading a reward spec: 'judge:0.6,concepts:0.3,my_rewards.py:brevity:0.1' into graders and weights.

`--reward.spec`, a task's mix in `--reward.tasks`, a row's own 'reward' field and eval.py's --graders are
all written this way; rewards/registry.py builds the graders they name.
"""

from __future__ import annotations

import math

from rewards.user import split_ref


def spec_entries(spec: str, flag: str = "--reward.spec") -> list[tuple[str, str, float]]:
    """'my_rewards.py:brevity:0.3,rouge_l:0.7' -> [('brevity', 'my_rewards.py:brevity', 0.3),
    ('rouge_l', 'rouge_l', 0.7)]: (the grader's name, what builds it with `make`, its weight). A user
    grader, 'file.py:function[:weight]', is named by its function; its path may not hold ',' or ':'."""
    out: list[tuple[str, str, float]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        ref = split_ref(part)
        if ref is not None:
            name, source, w = ref[1], f"{ref[0]}:{ref[1]}", ref[2]
        else:
            name, _, w = part.partition(":")
            name = source = name.strip()
            if name.endswith(".py"):
                raise ValueError(
                    f"{flag}: cannot read {part!r}; a grader of your own is 'file.py:function:weight', "
                    f"e.g. '{name}:my_reward:0.5'"
                )
        try:
            weight = float(w) if w.strip() else 1.0
        except ValueError:
            raise ValueError(
                f"{flag}: weight {w!r} of '{name}' is not a number; write e.g. '{source}:0.5'"
            ) from None
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"{flag}: weight of '{name}' must be a number >= 0, got {w!r}")
        twice = [s for n, s, _ in out if n == name]
        if twice and (ref is not None or twice[0] != name):  # a user grader is named by its function
            raise ValueError(
                f"{flag}: '{twice[0]}' and '{source}' are both named '{name}' (logged as reward/{name}); "
                "give each grader once, renaming a function if they differ"
            )
        if twice:
            raise ValueError(f"{flag}: grader '{name}' appears twice; give it once with its total weight")
        out.append((name, source, weight))
    if not out:
        raise ValueError(f"{flag} {spec!r} names nothing; write 'name:weight,name:weight', e.g. 'rouge_l:1'")
    if sum(w for _, _, w in out) <= 0:
        raise ValueError(f"{flag} {spec!r}: the weights sum to 0; give at least one grader a weight > 0")
    return out


def parse_spec(spec: str, flag: str = "--reward.spec") -> list[tuple[str, float]]:
    """'judge:0.6,concepts:0.3' -> [('judge', 0.6), ('concepts', 0.3)]; a bare name weighs 1; a user
    grader 'file.py:function:w' gives (function, w) (`spec_entries` keeps its file)."""
    return [(name, w) for name, _, w in spec_entries(spec, flag)]
