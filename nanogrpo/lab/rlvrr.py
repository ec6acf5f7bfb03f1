"""RLVRR's keyword ablation in one command: the keyword chains against TF-IDF and random keywords and against no
content reward, trained over seeds and judged on the same held-out answers.

    python -m nanogrpo.lab.rlvrr --model tiny --seeds 2 --out runs/rlvrr-tiny      # seconds a run, a smoke test
    python -m nanogrpo.lab.rlvrr --model smollm2 --seeds 3 --out runs/rlvrr-table   # SmolLM2-135M + LoRA, CPU

The arms (RLVRR's ablation on keyword choice, docs/PAPERS.md), each trained on the 24 open-ended rows of the
`rlvrr` recipe (nanogrpo/recipes/rlvrr.jsonl) with the preset's other settings:

- chains:     the recipe's own key points (the paper's LLM-drafted keyword chains), keywords:0.5,style:0.5;
- tfidf15/30: one key point of the reference's top tf-idf words, 15% / 30% of its words
              (`python -m nanogrpo.reward_data baseline`, nanogrpo/reward_data/baselines.py), same reward;
- random15/30: as many words of the reference drawn at random (random30 is not in the paper: --arms adds it);
- no-content: the style reward alone (keywords weighted 0: scored and logged, never rewarded).

Every arm trains with LoRA over the same seeds (`eval.py seeds`, nanogrpo/eval/seeds.py, in OUT/<arm>/seed<N>),
so each run ends with the trainer's held-out base-vs-trained eval on the recipe's 8 open-ended held-out rows
(nanogrpo/recipes/rlvrr.eval.jsonl), whose key points are the chains. Every arm is therefore judged by the
same numbers: `keywords` is the chains' content score whatever keywords the arm trained on, `style` the style
score, and ROUGE-L (a grader weighted 0) and token F1 compare the answer with the reference, independent of
any arm's reward. The table: per arm and metric, the trained model's mean ± std over seeds, and the paired
bootstrap 95% CI of arm - chains over (seed, prompt) pairs (nanogrpo/eval/stats.py, via seeds.compare_sets).

Where it departs from the paper: the paper trains 3B-8B models for one epoch over 10k rows and scores
benchmarks (AlpacaEval, Arena-Hard, ...) with judges; here a 135M model (or the random tiny one) trains a few
steps on 24 rows, and the held-out scores are the graders' own. It shows how to run and read the ablation,
not the paper's result (docs/RECIPES.md, "The keyword ablation").
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from nanogrpo.eval import seeds as seedruns
from nanogrpo.infra.metrics import replace_atomically
from nanogrpo.infra.outputs import output_folder
from nanogrpo.recipes import recipe_path
from nanogrpo.reward_data import baselines
from nanogrpo_base.ranges import at_least, check_ranges

CONTENT_SPEC = "keywords:0.5,style:0.5,rouge_l:0"  # the preset's average; rouge_l scored for the table only
STYLE_SPEC = "keywords:0,style:1,rouge_l:0"  # no content reward: keywords scored for the table only
METRICS = ("keywords", "style", "rouge_l", "f1")  # the held-out scores every arm is judged by
REFERENCE_ARM = "chains"


@dataclass(frozen=True)
class Arm:
    """One arm of the ablation: where its training rows' key points come from, and its reward."""

    what: str
    """One line for the console."""
    method: str = "chains"
    """'chains' (the recipe's key points), 'tfidf' or 'random' (`python -m nanogrpo.reward_data baseline`)."""
    share: float = 0.0
    """tfidf/random: keywords per reference word."""
    spec: str = CONTENT_SPEC
    """--reward.spec of the arm's runs."""


ARMS: dict[str, Arm] = {
    "chains": Arm("the recipe's key points (LLM-drafted chains)"),
    "tfidf15": Arm("TF-IDF, 15% of the reference", "tfidf", 0.15),
    "tfidf30": Arm("TF-IDF, 30% of the reference", "tfidf", 0.30),
    "random15": Arm("random words, 15% of the reference", "random", 0.15),
    "random30": Arm("random words, 30% of the reference", "random", 0.30),
    "no-content": Arm("style reward only", spec=STYLE_SPEC),
}
DEFAULT_ARMS = ("chains", "tfidf15", "tfidf30", "random15", "no-content")  # the paper's ablation


@dataclass(frozen=True)
class ModelSettings:
    """The training sizes of one model: small enough for a CPU, the rest is the rlvrr preset's."""

    steps: int
    """GRPO steps of each run (--steps overrides)."""
    prompts_per_step: int
    """Prompts per step."""
    group_size: int
    """Completions per prompt."""
    max_new_tokens: int
    """Longest completion, in training and in the held-out eval."""
    lr: float
    """LoRA learning rate."""
    lora_r: int
    """LoRA rank (alpha is twice it)."""
    dtype: str = "auto"
    """--model.dtype."""
    temperature: float = 1.0
    """Sampling temperature (the preset's)."""


MODELS: dict[str, ModelSettings] = {
    # a random 140k-parameter Llama: the table's plumbing in seconds; its numbers mean nothing
    "tiny": ModelSettings(
        steps=2, prompts_per_step=2, group_size=4, max_new_tokens=16, lr=1e-3, lora_r=4, dtype="float32"
    ),
    # SmolLM2-135M-Instruct, LoRA r 16 at lr 1e-4 (the preset's 5e-7 is a full-parameter rate, and these runs
    # are a few steps long); 64 new tokens: room for a few of a reference's keywords, not for the whole answer
    "smollm2": ModelSettings(
        steps=6, prompts_per_step=2, group_size=4, max_new_tokens=64, lr=1e-4, lora_r=16
    ),
}


@dataclass(frozen=True)
class TableArgs:
    """Train every arm of RLVRR's keyword ablation over seeds, then print one table of held-out scores."""

    out: str = "runs/rlvrr-table"
    """Output folder: data/ (each arm's training rows, the held-out rows), <arm>/seed<N>/ runs, table.md/json."""
    model: str = "tiny"
    """'tiny', 'smollm2', or a model folder (trained with smollm2's sizes)."""
    seeds: Annotated[int, at_least(1, "2 for a std")] = 3
    """How many seeds each arm trains with: 42, 123, 456 (Concept Overlap's), then 1000, 1001, ..."""
    arms: tuple[str, ...] = DEFAULT_ARMS
    """Arms to train: chains, tfidf15, tfidf30, random15, random30, no-content (chains is always one)."""
    steps: Annotated[int, at_least(0, "0 = the model's default")] = 0
    """GRPO steps per run (0 = the model's default: tiny 2, smollm2 6)."""
    eval_prompts: Annotated[int, at_least(1)] = 8
    """Held-out open-ended rows each run is evaluated on (the recipe has 8)."""
    threads: Annotated[int, at_least(1)] = 1
    """OMP_NUM_THREADS of each train.py (one thread is faster on a CPU that other work shares)."""
    resamples: Annotated[int, at_least(1)] = 10_000
    """Paired bootstrap resamples of each CI."""
    train_args: tyro.conf.Positional[tuple[str, ...]] = ()
    """More train.py flags, after `--` (they come last, so they override the arm's); not --seed/--out-dir."""


def seed_list(n: int) -> tuple[int, ...]:
    """The first n seeds: Concept Overlap's 42, 123, 456, then 1000, 1001, ..."""
    if n < 1:
        raise ValueError(f"--seeds {n}: give how many seeds each arm trains with, 1 or more (2 for a std)")
    return (*seedruns.DEFAULT_SEEDS, *range(1000, 1000 + n))[:n]


def open_rows(split: str, limit: int = 0) -> list[dict]:
    """The recipe's open-ended rows of a split, without their 'task' (every arm's reward is --reward.spec)."""
    rows = [json.loads(line) for line in recipe_path("rlvrr", split).read_text().splitlines() if line.strip()]
    rows = [{k: v for k, v in r.items() if k != "task"} for r in rows if r.get("task") == "open"]
    return rows[:limit] if limit else rows


def write_arm_data(data: Path, arms: Sequence[str], eval_prompts: int) -> tuple[dict[str, Path], Path]:
    """Each arm's training rows and the shared held-out rows under `data`; returns ({arm: file}, held-out file).
    The chains rows are the recipe's; the baselines rewrite their key points from the same rows."""
    chains, held_out = data / "chains.jsonl", data / "eval.jsonl"
    data.mkdir(parents=True, exist_ok=True)
    chains.write_text("".join(json.dumps(r) + "\n" for r in open_rows("train")))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in open_rows("eval", eval_prompts)))
    files = {}
    for name in arms:
        arm = ARMS[name]
        if arm.method == "chains":
            files[name] = chains
            continue
        files[name] = data / f"{name}.jsonl"
        args = baselines.BaselineArgs(str(chains), str(files[name]), arm.method, arm.share)  # type: ignore[arg-type]
        baselines.run(args)
    return files, held_out


def train_args(arm: str, rows: Path, held_out: Path, n_eval: int, a: TableArgs) -> list[str]:
    """train.py's preset and flags for one arm: the rlvrr preset with LoRA, the model's sizes, the arm's rows
    and reward, and the final held-out eval (no --eval-every: the base is the model with LoRA off)."""
    m = MODELS.get(a.model, MODELS["smollm2"])
    return [
        "rlvrr", "--model.path", a.model, "--model.dtype", m.dtype,
        "--lora.r", str(m.lora_r), "--lora.alpha", str(2 * m.lora_r), "--optim.lr", str(m.lr),
        "--epochs", "0", "--steps", str(a.steps or m.steps), "--prompts-per-step", str(m.prompts_per_step),
        "--grpo.group-size", str(m.group_size), "--sampling.max-new-tokens", str(m.max_new_tokens),
        "--sampling.temperature", str(m.temperature), "--data.train", str(rows), "--data.eval", str(held_out),
        "--eval-prompts", str(n_eval), "--eval-every", "0", "--reward.spec", ARMS[arm].spec, "--reward.tasks", "",
        "--no-plots", *a.train_args,
    ]  # fmt: skip


def check_args(a: TableArgs) -> None:
    unknown = [x for x in a.arms if x not in ARMS]
    if unknown:
        raise ValueError(f"--arms: no arm {', '.join(unknown)}; the arms are {', '.join(ARMS)}")
    if REFERENCE_ARM not in a.arms:
        raise ValueError(f"--arms {' '.join(a.arms)}: add chains, the arm every other is compared with")
    if len(set(a.arms)) != len(a.arms):
        raise ValueError(f"--arms {' '.join(a.arms)}: give each arm once")
    if a.eval_prompts < 1:
        raise ValueError(
            f"--eval-prompts {a.eval_prompts}: evaluate on 1 or more held-out rows (the recipe has 8)"
        )
    seedruns.check_train_args(a.train_args)


# ----------------------------------------------------------------------------------------------------------
# the table


def arm_table(out: Path, arms: Sequence[str], seeds: Sequence[int], resamples: int = 10_000) -> dict:
    """Per arm and metric: the trained model's mean ± std over seeds (seeds.seeds_summary) and, but for chains,
    the paired bootstrap of arm - chains (seeds.compare_sets); 'base' is the model with LoRA off (chains' runs)."""
    runs = {arm: seedruns.load_runs(out / arm, seeds) for arm in arms}
    ref = runs[REFERENCE_ARM]
    base = seedruns.seeds_summary(ref)
    res: dict = {
        "out": str(out),
        "seeds": [r.seed for r in ref],
        "resamples": resamples,
        "base": {m: base[m]["base"] for m in METRICS if m in base},
        "arms": {},
    }
    for arm in arms:
        summary = seedruns.seeds_summary(runs[arm])
        vs = seedruns.compare_sets(runs[arm], ref, resamples)["metrics"] if arm != REFERENCE_ARM else {}
        res["arms"][arm] = {
            "what": ARMS[arm].what,
            "spec": ARMS[arm].spec,
            "prompts": {m: summary[m]["n"] for m in METRICS if m in summary},
            "trained": {m: summary[m]["trained"] for m in METRICS if m in summary},
            "vs_chains": {m: {k: vs[m][k] for k in ("n", "diff", "low", "high")} for m in METRICS if m in vs},
        }
    return res


def format_table(res: dict) -> str:
    """The table as Markdown: a row per arm (and the untrained base), per metric its score and CI vs chains."""
    metrics = [m for m in METRICS if m in res["base"]]
    head = ["arm"] + [x for m in metrics for x in (m, "Δ vs chains [95% CI]")]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|---|" * len(metrics)]
    base = [x for m in metrics for x in (seedruns._pm(res["base"][m]), "")]
    lines.append("| base (LoRA off) | " + " | ".join(base) + " |")
    for arm, row in res["arms"].items():
        cells = []
        for m in metrics:
            s = row["trained"].get(m)
            cells.append(seedruns._pm(s) if s else "-")
            d = row["vs_chains"].get(m)
            sig = "*" if d and (d["low"] > 0 or d["high"] < 0) else ""
            cells.append(f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]{sig}" if d else "")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    n = {p for row in res["arms"].values() for v in row["prompts"].values() for p in v.values()}
    lines += [
        "",
        f"Held-out: {'/'.join(map(str, sorted(n)))} open-ended rows of recipe:rlvrr, greedy; seeds "
        f"{', '.join(map(str, res['seeds']))}. Each score: mean ± std over seeds of each seed's mean over the rows. "
        "keywords: the content score against the recipe's key points (the chains) for every arm; style: the "
        "style checks; rouge_l and f1: against the reference. Δ: arm - chains over (seed, row) pairs pooled "
        f"across seeds, paired bootstrap 95% CI ({res['resamples']} resamples); * = the CI excludes 0.",
    ]
    return "\n".join(lines)


def run(a: TableArgs) -> dict:
    """Write the arms' data, train every arm over the seeds (finished runs are skipped), print the table."""
    check_args(a)
    seeds = seed_list(a.seeds)
    # '' (the current folder), a file, or a folder holding anything but this table's own files: refused now
    out = output_folder(a.out, "--out", {"data", "table.md", "table.json", *ARMS})
    t0 = time.perf_counter()
    files, held_out = write_arm_data(out / "data", a.arms, a.eval_prompts)
    n_eval = sum(1 for line in held_out.read_text().splitlines() if line.strip())
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the train.py subprocesses inherit it
    for k, arm in enumerate(a.arms):
        print(
            f"\n[rlvrr {k + 1}/{len(a.arms)}] arm {arm}: {ARMS[arm].what}; reward {ARMS[arm].spec}",
            flush=True,
        )
        seedruns.run_seeds(out / arm, train_args(arm, files[arm], held_out, n_eval, a), seeds)
    res = arm_table(out, a.arms, seeds, a.resamples)
    res.update(model=a.model, wall_s=round(time.perf_counter() - t0, 1), argv=sys.argv[1:])
    md = format_table(res)
    replace_atomically(out / "table.md", md + "\n")  # whole, or as it was
    replace_atomically(out / "table.json", json.dumps(res, indent=2) + "\n")
    print(f"\n{md}\n\nwrote {out}/table.md and table.json in {res['wall_s']:.0f} s")
    return res


def main(argv: Sequence[str] | None = None) -> None:
    args = tyro.cli(TableArgs, args=argv, description=__doc__.split("\n\n")[0])
    try:
        check_ranges(args)  # each number in the range on its field
        run(args)
    except ValueError as e:  # bad flags, or a train.py run that failed (its output is above): one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
