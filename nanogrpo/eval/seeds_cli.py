"""eval.py's `seeds` and `seeds-table` commands: their flags, and the table they print and write.

    python eval.py seeds --out runs/grpo3 -- tiny --steps 4 --eval-prompts 8   # train.py once per seed
    python eval.py seeds-table runs/grpo3 --baseline runs/sft3                  # the table again, vs SFT

The runs, their statistics and the table itself are nanogrpo/eval/seeds.py's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import tyro

from nanogrpo.eval.seeds import DEFAULT_SEEDS, format_markdown, run_seeds, table, write_table
from nanogrpo_base.ranges import at_least


@dataclass(frozen=True)
class SeedsArgs:
    """Train over seeds (train.py once per seed, in OUT/seed<N>; finished seeds skipped), then the table."""

    out: str
    """The run set's folder: one run per seed in OUT/seed<N>."""
    train_args: tyro.conf.Positional[tuple[str, ...]] = ()
    """train.py's preset and flags, after `--` (e.g. `-- tiny --steps 4 --eval-prompts 8`); the runs need
    --eval-prompts N and LoRA. Not --seed, --out-dir or --resume: the seeds command sets those."""
    seeds: Annotated[tuple[int, ...], at_least(0)] = DEFAULT_SEEDS
    """Seeds, one run each (Concept Overlap's by default)."""
    baseline: str = ""
    """Another run set (e.g. SFT over the same seeds) to compare the trained models with."""
    resamples: Annotated[int, at_least(1)] = 10_000
    """Paired bootstrap resamples (the comparison with --baseline)."""
    bootstrap_seed: Annotated[int, at_least(0)] = 0
    """Seed of the bootstrap resamples."""
    json: str = ""
    """'-' prints the JSON instead of the Markdown (both are written to OUT either way)."""


@dataclass(frozen=True)
class TableArgs:
    """The table of a run set written by `eval.py seeds`: mean ± std over seeds; vs a baseline set."""

    runs: tyro.conf.Positional[str]
    """The run set's folder (seed<N>/ run folders)."""
    seeds: Annotated[tuple[int, ...], at_least(0)] = ()
    """Only these seeds (default: every finished run in the folder)."""
    baseline: str = ""
    """Another run set to compare the trained models with, on pairs matched by seed and prompt id."""
    resamples: Annotated[int, at_least(1)] = 10_000
    """Paired bootstrap resamples."""
    bootstrap_seed: Annotated[int, at_least(0)] = 0
    """Seed of the bootstrap resamples."""
    json: str = ""
    """'-' prints the JSON instead of the Markdown (both are written to RUNS either way)."""


def run_seeds_cli(args: SeedsArgs) -> None:
    run_seeds(args.out, args.train_args, args.seeds)
    _print_table(args.out, args.baseline, args.resamples, args.bootstrap_seed, args.json, args.seeds)


def run_table_cli(args: TableArgs) -> None:
    _print_table(args.runs, args.baseline, args.resamples, args.bootstrap_seed, args.json, args.seeds)


def _print_table(
    folder: str, baseline: str, n_resamples: int, seed: int, as_json: str, seeds: Sequence[int]
) -> None:
    res = table(folder, baseline, n_resamples, seed, seeds)
    md, js = write_table(folder, res)
    print(json.dumps(res, indent=2) if as_json == "-" else f"\n{format_markdown(res)}\n\nwrote {md}, {js}")
