"""`python -m nanogrpo.probe {train,eval}`: the rubric probes' command line with nanogrpo's model names.

rewards/ imports nothing of nanogrpo, so `python -m rewards.probe` takes a model folder only. This entry
registers nanogrpo as the model backend first (nanogrpo.judge_backend), then runs the same command line
(rewards/probe/cli.py): `--model` takes what train.py's --model.path takes, 'tiny', 'smollm2',
'random:SHAPE' or an HF folder, and so does the model a probe was trained on when `eval` loads it.

    python -m nanogrpo.probe train --data labels.jsonl --model smollm2 --out probes/mytask
    python -m nanogrpo.probe eval --data test.jsonl --probe probes/mytask
"""

from __future__ import annotations

from collections.abc import Sequence

from nanogrpo import judge_backend
from rewards.probe.cli import main as probe_main


def main(argv: Sequence[str] | None = None) -> None:
    judge_backend.register()
    probe_main(argv, prog="python -m nanogrpo.probe")


if __name__ == "__main__":
    main()
