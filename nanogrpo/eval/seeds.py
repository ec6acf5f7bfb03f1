"""Runs over seeds, and their table: mean ± std over seeds, and a paired comparison with a baseline set.

    python eval.py seeds --out runs/grpo3 -- tiny --steps 4 --eval-prompts 8   # train.py once per seed
    python eval.py seeds-table runs/grpo3 --baseline runs/sft3                  # the table again, vs SFT

A run set is a folder of run folders, one per seed: OUT/seed42, OUT/seed123, OUT/seed456 (Concept Overlap's seeds).
`seeds` runs train.py in a subprocess for each seed that has not finished (a finished run has summary.json;
one that stopped part-way is resumed with --resume), then prints the table. Every run must end with the
held-out eval (--eval-prompts N and LoRA): its eval_base.jsonl / eval_trained.jsonl hold one score per
prompt and metric (EM, F1, SeqM and the training graders; nanogrpo/eval/evaluate.py `save_eval`).

The table, per metric: the mean over seeds of each seed's mean over its prompts, ± the sample standard
deviation over seeds (n - 1 in the denominator), for the base model (LoRA off), the trained model and
their difference. Against a baseline set, the trained models are compared on pairs matched by seed and
prompt id, pooled over the seeds both sets ran: the paired bootstrap 95% CI of the mean difference and,
for a metric whose every score is 0 or 1 (EM), McNemar's exact test (both from nanogrpo/eval/stats.py).
Pooling treats each (seed, prompt) pair as one item, as Concept Overlap reports it.
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nanogrpo.eval import stats
from nanogrpo.eval.evaluate import read_jsonl
from nanogrpo.infra.config_file import flat_config
from nanogrpo.infra.metrics import replace_atomically
from nanogrpo.infra.outputs import output_folder

DEFAULT_SEEDS = (42, 123, 456)
TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"
# flags the seeds command sets itself for every run
_OWN_FLAGS = ("--seed", "--out-dir", "--out_dir", "--resume")
_RUN_NAME = re.compile(r"seed(-?\d+)")
# config keys that differ between the runs of one set by design
_PER_RUN_KEYS = ("seed", "out_dir", "resume")

Scores = dict[str, float | None]


class SeedRunError(ValueError):
    """A train.py run of the set failed (a ValueError, so eval.py prints one line)."""


# ----------------------------------------------------------------------------------------------------------
# running train.py once per seed


def seed_dir(out: str | Path, seed: int) -> Path:
    return Path(out) / f"seed{seed}"


def is_set_entry(name: str) -> bool:
    """A name the seeds command writes in a run set: seed<N>/ runs and the seeds*.md / seeds*.json tables."""
    return bool(_RUN_NAME.fullmatch(name)) or (name.startswith("seeds") and name.endswith((".md", ".json")))


def run_state(run_dir: Path) -> str:
    """'done' (summary.json: train.py wrote it last), 'partial' (it logged steps or checkpoints: resume it)
    or 'new' (nothing yet, or only a config.json, which train.py overwrites)."""
    if (run_dir / "summary.json").exists():
        return "done"
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "ckpt").exists():
        return "partial"
    return "new"


def check_train_args(train_args: Sequence[str]) -> None:
    """Refuse the flags the seeds command sets per run."""
    for arg in train_args:
        name = arg.split("=", 1)[0]
        if name in _OWN_FLAGS:
            raise ValueError(
                f"{name} is set for every run by the seeds command (--seeds, --out OUT gives OUT/seed<N>, "
                f"an unfinished run is resumed): drop {arg} from train.py's flags"
            )


def train_command(train_args: Sequence[str], seed: int, run_dir: Path, resume: bool) -> list[str]:
    """train.py's command line for one seed: the preset and flags as given, then the run's own flags."""
    cmd = [sys.executable, str(TRAIN_PY), *train_args, "--seed", str(seed), "--out-dir", str(run_dir)]
    return cmd + ["--resume"] if resume else cmd


def run_seeds(
    out: str | Path, train_args: Sequence[str], seeds: Sequence[int] = DEFAULT_SEEDS, echo: Callable = print
) -> list[Path]:
    """Run train.py for every seed whose run has not finished, one after another, each in its own process
    (a fresh interpreter: no state carries from one seed to the next). Returns the run folders. `out` is
    refused before any run when it is '', a file, or a folder holding anything but a run set's own files."""
    output_folder(str(out), "--out", is_set_entry)
    check_train_args(train_args)
    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError(f"--seeds {' '.join(map(str, seeds))}: give one or more distinct seeds")
    if not TRAIN_PY.is_file():
        raise ValueError(f"{TRAIN_PY} not found: run eval.py seeds from a checkout of nanogrpo")
    todo = [s for s in seeds if run_state(seed_dir(out, s)) != "done"]
    for s in seeds:
        if s not in todo:
            echo(f"[seeds] seed {s}: finished already ({seed_dir(out, s)}/summary.json), skipped", flush=True)
    t0 = time.perf_counter()
    for k, s in enumerate(todo):
        run_dir = seed_dir(out, s)
        resume = run_state(run_dir) == "partial"
        cmd = train_command(train_args, s, run_dir, resume)
        how = "resuming" if resume else "running"
        shown = shlex.join(["python", "train.py", *cmd[2:]])
        echo(f"[seeds {k + 1}/{len(todo)}] seed {s}: {how} {shown}", flush=True)
        t1 = time.perf_counter()
        # the run's own output (its progress bar, console lines, held-out table) goes straight through
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            done = [x for x in seeds if run_state(seed_dir(out, x)) == "done"]
            raise SeedRunError(
                f"train.py failed for seed {s} (exit {rc}, its output is above); fix the cause and run the "
                f"same command again: finished seeds ({', '.join(map(str, done)) or 'none yet'}) are skipped"
            )
        spent = time.perf_counter() - t0
        left = spent / (k + 1) * (len(todo) - k - 1)
        echo(
            f"[seeds {k + 1}/{len(todo)}] seed {s}: done in {time.perf_counter() - t1:.0f}s"
            + (f", about {left:.0f}s left" if left else ""),
            flush=True,
        )
    return [seed_dir(out, s) for s in seeds]


# ----------------------------------------------------------------------------------------------------------
# reading a run set


@dataclass(frozen=True)
class SeedRun:
    """One finished run: its held-out scores per prompt id, for the base and the trained model."""

    seed: int
    path: Path
    base: dict[object, Scores]
    trained: dict[object, Scores]
    config: dict


def _scores_by_id(path: Path) -> dict[object, Scores]:
    rows = read_jsonl(path, require=("scores",))
    by_id = {row["id"]: row["scores"] for row in rows}
    if len(by_id) != len(rows):
        raise ValueError(f"{path}: prompt ids repeat; the held-out rows need distinct ids to be paired")
    return by_id


def load_run(path: Path, seed: int) -> SeedRun:
    """A run folder's held-out eval files (train.py --eval-prompts N) and config."""
    files = [path / f"eval_{side}.jsonl" for side in ("base", "trained")]
    for f in files:
        if not f.is_file():
            raise ValueError(
                f"{f} not found: the run has no held-out eval; train with --eval-prompts N and LoRA "
                "(and --data.eval FILE unless the task is demo), then run the seeds command again"
            )
    from nanogrpo.eval.report import run_json  # a torn config.json: one error naming it

    config = run_json(path / "config.json") or {}
    return SeedRun(seed, path, _scores_by_id(files[0]), _scores_by_id(files[1]), config)


def load_runs(folder: str | Path, seeds: Sequence[int] = ()) -> list[SeedRun]:
    """The finished seed<N> runs of a run set (those of `seeds`, default all), by seed."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder; give a run set written by `eval.py seeds --out FOLDER`")
    found = []
    for sub in folder.iterdir():
        m = _RUN_NAME.fullmatch(sub.name)
        if m and sub.is_dir() and run_state(sub) == "done" and (not seeds or int(m.group(1)) in seeds):
            found.append(load_run(sub, int(m.group(1))))
    if not found:
        which = f" of seeds {' '.join(map(str, seeds))}" if seeds else ""
        raise ValueError(
            f"{folder}: no finished runs{which} (seed<N>/summary.json); run `eval.py seeds --out {folder} "
            "-- ...` first"
        )
    return sorted(found, key=lambda r: r.seed)


def config_differences(runs: Sequence[SeedRun]) -> list[str]:
    """The config keys whose values differ between runs of one set, apart from seed and folder: a set
    whose runs were trained with different flags is not one method over seeds."""
    flat = [flat_config(r.config) for r in runs]
    keys = sorted({k for f in flat for k in f} - set(_PER_RUN_KEYS))
    return [k for k in keys if len({json.dumps(f.get(k)) for f in flat}) > 1]


# ----------------------------------------------------------------------------------------------------------
# statistics


def _metric_names(runs: Sequence[SeedRun]) -> list[str]:
    names: dict[str, None] = {}
    for r in runs:
        for scores in r.trained.values():
            names.update(dict.fromkeys(scores))
    return list(names)


def paired_values(x: dict[object, Scores], y: dict[object, Scores], metric: str) -> list[tuple[float, float]]:
    """(x, y) scores of a metric on the prompt ids both have scored (a None score drops its pair)."""
    pairs = [(x[i].get(metric), y[i].get(metric)) for i in x if i in y]
    return [(a, b) for a, b in pairs if a is not None and b is not None]


def mean_std(per_seed: dict[int, float]) -> dict:
    """Mean and sample std (n - 1; None with one seed) over seeds of the per-seed values."""
    vals = list(per_seed.values())
    return {
        "mean": statistics.fmean(vals) if vals else None,
        "std": statistics.stdev(vals) if len(vals) > 1 else None,
        "per_seed": {str(s): v for s, v in per_seed.items()},
    }


def seeds_summary(runs: Sequence[SeedRun]) -> dict:
    """Per metric: prompts per seed, and mean ± std over seeds of base, trained and delta (trained - base),
    each seed's value the mean over the prompts both models have a score for."""
    out = {}
    for m in _metric_names(runs):
        sides: dict[str, dict[int, float]] = {"base": {}, "trained": {}, "delta": {}}
        n = {}
        for r in runs:
            pairs = paired_values(r.base, r.trained, m)
            if not pairs:
                continue
            n[str(r.seed)] = len(pairs)
            sides["base"][r.seed] = statistics.fmean(a for a, _ in pairs)
            sides["trained"][r.seed] = statistics.fmean(b for _, b in pairs)
            sides["delta"][r.seed] = statistics.fmean(b - a for a, b in pairs)
        if n:
            out[m] = {"n": n, **{side: mean_std(v) for side, v in sides.items()}}
    return out


def is_binary(values: Sequence[float]) -> bool:
    """Every score 0 or 1 (EM, or a yes/no grader): McNemar's test applies."""
    return all(v in (0.0, 1.0) for v in values)


def compare_sets(
    runs: Sequence[SeedRun], baseline: Sequence[SeedRun], n_resamples: int = 10_000, seed: int = 0
) -> dict:
    """The trained models of `runs` against those of `baseline`, on pairs matched by seed and prompt id,
    pooled over the seeds both sets ran: per metric, both sides' mean ± std over those seeds, the paired
    bootstrap of mean(runs) - mean(baseline), and McNemar's exact test when every score is 0 or 1."""
    ours = {r.seed: r for r in runs}
    theirs = {r.seed: r for r in baseline}
    shared = sorted(set(ours) & set(theirs))
    if not shared:
        raise ValueError(
            f"the run sets share no seed (seeds {sorted(ours)} vs baseline {sorted(theirs)}): run the "
            "baseline over the same --seeds"
        )
    metrics = {}
    for m in _metric_names(runs):
        a, b, per_a, per_b = [], [], {}, {}
        for s in shared:
            pairs = paired_values(theirs[s].trained, ours[s].trained, m)
            if pairs:
                a += [x for x, _ in pairs]
                b += [y for _, y in pairs]
                per_a[s] = statistics.fmean(x for x, _ in pairs)
                per_b[s] = statistics.fmean(y for _, y in pairs)
        if not a:
            continue
        res = stats.paired_bootstrap(a, b, n_resamples, seed)
        res.update(baseline_seeds=mean_std(per_a), seeds=mean_std(per_b))
        if is_binary(a + b):
            res["mcnemar"] = stats.mcnemar_exact([x >= 0.5 for x in a], [y >= 0.5 for y in b])
        metrics[m] = res
    if not metrics:
        raise ValueError(
            "the run sets share no scored prompt ids: evaluate both on the same held-out rows "
            "(the same --data.eval and --eval-prompts)"
        )
    ids = [set(ours[s].trained) ^ set(theirs[s].trained) for s in shared]
    return {
        "seeds": shared,
        "seeds_dropped": sorted(set(ours) ^ set(theirs)),
        "ids_dropped": sum(len(x) for x in ids),
        "resamples": n_resamples,
        "bootstrap_seed": seed,
        "metrics": metrics,
    }


def table(
    folder: str | Path,
    baseline: str | Path = "",
    n_resamples: int = 10_000,
    seed: int = 0,
    seeds: Sequence[int] = (),
) -> dict:
    """The JSON of a run set's table over `seeds` (default: every finished run), and of its comparison
    with a baseline set when one is given."""
    runs = load_runs(folder, seeds)
    out = {
        "runs": str(folder),
        "seeds": [r.seed for r in runs],
        "config_differs": config_differences(runs),
        "metrics": seeds_summary(runs),
    }
    if baseline:
        base_runs = load_runs(baseline, seeds)
        out["baseline"] = {
            "runs": str(baseline),
            "config_differs": config_differences(base_runs),
            **compare_sets(runs, base_runs, n_resamples, seed),
        }
    return out


# ----------------------------------------------------------------------------------------------------------
# Markdown


def _pm(s: dict, sign: bool = False) -> str:
    """'0.700 ± 0.005' from a mean_std dict ('-' for the std of one seed)."""
    if s["mean"] is None:
        return "-"
    mean = f"{s['mean']:+.3f}" if sign else f"{s['mean']:.3f}"
    return mean + (f" ± {s['std']:.3f}" if s["std"] is not None else "")


def _n(n: dict[str, int]) -> str:
    """Prompts per seed: one number when every seed has the same."""
    vals = sorted(set(n.values()))
    return str(vals[0]) if len(vals) == 1 else "/".join(str(n[s]) for s in n)


def format_markdown(res: dict) -> str:
    """The table of `table`'s JSON as Markdown: over seeds, then (with a baseline) the paired comparison."""
    seeds = ", ".join(map(str, res["seeds"]))
    lines = [
        f"### {res['runs']}: {len(res['seeds'])} seeds ({seeds})",
        "",
        "| metric | prompts | base | trained | delta |",
        "|---|---:|---:|---:|---:|",
    ]
    for m, s in res["metrics"].items():
        lines.append(
            f"| {m} | {_n(s['n'])} | {_pm(s['base'])} | {_pm(s['trained'])} | {_pm(s['delta'], True)} |"
        )
    lines += [
        "",
        "mean ± std over seeds (sample std, n - 1) of each seed's mean over its held-out prompts; "
        "base: the model with LoRA off; delta: trained - base.",
    ]
    lines += _config_note(res["runs"], res["config_differs"])
    if "baseline" in res:
        lines += [""] + _comparison_lines(res)
    return "\n".join(lines)


def _comparison_lines(res: dict) -> list[str]:
    b = res["baseline"]
    ours, theirs = Path(res["runs"]).name, Path(b["runs"]).name
    if ours == theirs:
        ours, theirs = res["runs"], b["runs"]
    lines = [
        f"### {res['runs']} vs {b['runs']}: trained models, seeds {', '.join(map(str, b['seeds']))}",
        "",
        f"| metric | pairs | {theirs} | {ours} | diff | 95% CI | McNemar p |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for m, s in b["metrics"].items():
        sig = "*" if s["low"] > 0 or s["high"] < 0 else ""
        mc = s.get("mcnemar")
        p = f"{mc['p']:.3g} ({mc['only_a']}/{mc['only_b']})" if mc else ""
        lines.append(
            f"| {m} | {s['n']} | {_pm(s['baseline_seeds'])} | {_pm(s['seeds'])} | {s['diff']:+.3f} | "
            f"[{s['low']:+.3f}, {s['high']:+.3f}]{sig} | {p} |"
        )
    lines += [
        "",
        f"diff = {ours} - {theirs} over (seed, prompt) pairs pooled across the seeds; paired bootstrap "
        f"95% CI ({b['resamples']} resamples, seed {b['bootstrap_seed']}), * = excludes 0; McNemar's exact "
        f"test where every score is 0 or 1, (right only for {theirs} / right only for {ours}).",
    ]
    if b["seeds_dropped"] or b["ids_dropped"]:
        lines.append(
            f"Dropped: seeds in only one set {b['seeds_dropped'] or 'none'}; "
            f"{b['ids_dropped']} (seed, prompt) ids in only one set."
        )
    return lines + _config_note(b["runs"], b["config_differs"])


def _config_note(folder: str, keys: list[str]) -> list[str]:
    if not keys:
        return []
    return [f"Warning: the runs of {folder} differ in config {', '.join(keys)}: not one method over seeds."]


def write_table(folder: str | Path, res: dict) -> tuple[Path, Path]:
    """FOLDER/seeds.{md,json}, or FOLDER/seeds_vs_<baseline>.{md,json} with a baseline."""
    stem = "seeds" + (f"_vs_{Path(res['baseline']['runs']).name}" if "baseline" in res else "")
    md, js = Path(folder) / f"{stem}.md", Path(folder) / f"{stem}.json"
    replace_atomically(md, format_markdown(res) + "\n")  # whole or as it was
    replace_atomically(js, json.dumps(res, indent=2) + "\n")
    return md, js
