"""`python -m nanogrpo.eval.probe {train,eval,compare}`: the rubric probes' command line with nanogrpo's model names.

rewards/ imports nothing of nanogrpo, so `python -m rewards.probe` takes a model folder only. This entry
registers nanogrpo as the model backend first (nanogrpo.judge_backend), then runs the same command line
(rewards/probe_cli.py): `--model` takes what train.py's --model.path takes, 'tiny', 'smollm2',
'random:SHAPE' or an HF folder, and so does the model a probe was trained on when `eval` loads it.
`compare` is nanogrpo's own: it scores the generative, log-prob and probe readouts of one model side by
side on labelled rows (Small-LM Judges's comparison; nanogrpo/eval/readouts.py), and needs the local judge
backend, which only nanogrpo provides.

    python -m nanogrpo.eval.probe train --data labels.jsonl --model smollm2 --out probes/mytask
    python -m nanogrpo.eval.probe eval --data test.jsonl --probe probes/mytask
    python -m nanogrpo.eval.probe compare --data labels.jsonl --model smollm2 --out runs/readouts
"""

from __future__ import annotations

from collections.abc import Sequence

from nanogrpo import judge_backend
from rewards.probe_cli import main as probe_main


def main(argv: Sequence[str] | None = None) -> None:
    from nanogrpo.eval.readouts import compare

    judge_backend.register()
    probe_main(argv, prog="python -m nanogrpo.eval.probe", extra={"compare": compare})


if __name__ == "__main__":
    main()
