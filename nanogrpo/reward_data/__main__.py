"""Command line of the reward-data builds: `python -m nanogrpo.reward_data SUBCOMMAND [--flags]`.

Each subcommand's flags are listed by `python -m nanogrpo.reward_data SUBCOMMAND --help`; the subcommands
are described in nanogrpo/reward_data/__init__.py and docs/REWARD_DATA.md.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import tyro

from nanogrpo import judge_backend
from nanogrpo.reward_data import baselines, keypoints, rubric, style
from nanogrpo.reward_data import filter as row_filter  # not `filter`: the builtin
from nanogrpo_base.ranges import check_ranges

COMMANDS = {
    "keypoints": (keypoints.KeypointsArgs, keypoints.run),
    "style": (style.StyleArgs, style.run),
    "rubric": (rubric.RubricArgs, rubric.run_rubric),
    "label": (rubric.LabelArgs, rubric.run_label),
    "filter": (row_filter.FilterArgs, row_filter.run),
    "baseline": (baselines.BaselineArgs, baselines.run),
}


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the subcommand and its flags, run it; a bad flag or bad data exits 2 with one line."""
    import nanogrpo.reward_data as pkg

    args = tyro.extras.subcommand_cli_from_dict(
        {name: cls for name, (cls, _) in COMMANDS.items()},
        prog="python -m nanogrpo.reward_data",
        args=argv,
        description=pkg.__doc__.split("\n\n")[0],
    )
    judge_backend.register()  # a --llm.backend local model runs on nanogrpo's model and sampler
    runner = next(run for cls, run in COMMANDS.values() if isinstance(args, cls))
    try:
        check_ranges(args)  # each number in the range on its field
        runner(args)
    except ValueError as e:  # bad data or flags (and a judge server that refuses): one clear line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
