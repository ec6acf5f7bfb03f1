"""The research agent's judge cost: the probe readout against a generative judge on the same episodes, and each
one's share of a GRPO step. Small-LM Judges reports its probe judge 10.7x faster than generative verdicts; this
measures the same comparison at nanogrpo's scale (SmolLM2-135M as the frozen LM of both, on this machine).

    python bench/research_judge.py --run runs/research/grpo     # after python -m nanogrpo.lab.research run
    python bench/research_judge.py --run runs/research/grpo --episodes 8   # fewer episodes: quicker

The episodes are the run's held-out ones (eval_trained.jsonl: whole transcripts, as the judges read them in
training), each judged on its row's rubric (two criteria) by a fresh grader, so nothing comes from a cache:
the probe (the run's --reward.rubric.probe, its frozen LM cut after the probe's layer) and the generative
readout (the same SmolLM2 in process, `--reward.judge.backend local`, up to 8 new tokens a verdict), one after
the other, each after a warm-up call that loads its model. A step's share is the judge's time for the step's
episodes (--prompts-per-step x --grpo.group-size of the run) over that plus the run's median sampling and
update time (metrics.jsonl). Prints a table last, then the command that reproduces it.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from cpu_check import cpu_line  # bench/cpu_check.py: the CPU's name, cores and flags

from nanogrpo import judge_backend
from rewards import RewardConfig, Sample, build_reward
from rewards.options import JudgeConfig, RubricConfig


def episodes(run: Path, n: int) -> list[Sample]:
    """The run's first n held-out episodes as the trainer hands them to the graders."""
    rows = [
        json.loads(line) for line in (run / "eval_trained.jsonl").read_text().splitlines() if line.strip()
    ]
    out = []
    for r in rows[:n]:
        turns = r.get("turns") or None
        out.append(
            Sample(turns[0]["content"] if turns else str(r["prompt"]), r["completion"], row=r, turns=turns)
        )
    return out


def judge_seconds(cfg: RewardConfig, samples: list[Sample]) -> tuple[float, list[float | None]]:
    """Seconds to grade `samples` with a fresh rubric grader (after a warm-up on one other sample)."""
    grader = build_reward(cfg).graders["rubric"]
    grader([samples[-1]])  # loads the judge's model (no --reward.judge.cache: nothing is kept)
    t0 = time.perf_counter()
    scores = grader(samples[:-1])
    return time.perf_counter() - t0, scores


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/research/grpo", help="a research GRPO run folder")
    ap.add_argument("--episodes", type=int, default=13, help="held-out episodes judged (one is the warm-up)")
    args = ap.parse_args()
    judge_backend.register()  # 'smollm2' names nanogrpo's model folder, as in train.py
    run = Path(args.run)
    cfg = json.loads((run / "config.json").read_text())
    samples = episodes(run, args.episodes)
    timed = len(samples) - 1
    probe = RewardConfig(
        spec="rubric:1", rubric=RubricConfig(readout="probe", probe=cfg["reward"]["rubric"]["probe"])
    )
    local = replace(JudgeConfig(), backend="local", model="smollm2")
    gen = RewardConfig(spec="rubric:1", judge=local, rubric=RubricConfig(readout="generative"))
    t_probe, s_probe = judge_seconds(probe, samples)
    t_gen, s_gen = judge_seconds(gen, samples)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    policy = statistics.median(m["t_step"] - m["t_score"] for m in steps if "t_step" in m)  # sampling, update
    per_step = cfg["prompts_per_step"] * cfg["grpo"]["group_size"]
    agree = sum((a or 0) == (b or 0) for a, b in zip(s_probe, s_gen)) / timed
    print(f"# {cpu_line()}; {platform.python_implementation()} {platform.python_version()}")
    print(f"# {timed} episodes x 2 criteria of {run}/eval_trained.jsonl; a step: {per_step} episodes, "
          f"its sampling + update {policy:.1f} s (median of {len(steps)} steps)")  # fmt: skip
    print(f"{'judge':12s} {'s/episode':>10s} {'s a step':>9s} {'share':>6s}")
    for name, t in (("probe", t_probe), ("generative", t_gen)):
        judge = t / timed * per_step
        print(f"{name:12s} {t / timed:10.3f} {judge:9.1f} {judge / (judge + policy):6.0%}")
    print(
        f"generative / probe: {t_gen / t_probe:.1f}x (Small-LM Judges: 10.7x); same episode score {agree:.0%}"
    )
    print(f"# python bench/research_judge.py --run {args.run} --episodes {args.episodes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
