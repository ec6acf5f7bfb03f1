"""nanogrpo evaluation: `python eval.py {generate,score,grade,compare,elo,report,seeds,seeds-table} [--flags]`.

  generate  completions of a model (+ LoRA adapter) on a held-out JSONL -> completions JSONL
  score     EM, token F1, SeqM, ROUGE-L and any graders per row, means with 95% bootstrap CIs;
            with k samples per prompt also best@k and Self-BLEU
  grade     one grader (or a weighted mix) per row as JSON lines; agreement with a `human` column
  compare   two systems on the same ids: paired bootstrap CI of each difference, McNemar on EM, distinct answers
  elo       pairwise judging of two or more systems (both orders), Bradley-Terry Elo with CIs
  report    (re)draw a run folder's plots and its index.html
  seeds     train.py over seeds (42 123 456), then seeds-table on the runs
  seeds-table  mean ± std over seeds per metric; vs a baseline run set: paired bootstrap CI, McNemar

Each subcommand's flags are listed by `python eval.py SUBCOMMAND --help`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import tyro

from nanogrpo.config import EnvConfig
from nanogrpo.envs.spec import check_start, resolve_env
from nanogrpo.eval import elo_plots, evaluate, generation, overlay, pairwise, provenance, report, seeds_cli
from nanogrpo.formats import jsonl_text, write_jsonl
from nanogrpo.infra.outputs import output_file, write_or_keep
from nanogrpo_base.ranges import above, at_least, check_ranges, within
from rewards import grade as rewards_grade
from rewards.grade import GradeArgs
from rewards.options import JudgeConfig, RewardConfig

Positional = tyro.conf.Positional


@dataclass(frozen=True)
class Generate:
    """Completions of a model on a held-out JSONL; writes each row with a `completion` field."""

    data: str
    """Held-out JSONL (the training data format: prompt, reference, ...), or 'demo' (the built-in task's held-out split)."""
    model: str = "smollm2"
    """HF-format model folder, or 'smollm2' / 'tiny' (see train.py --model.path)."""
    adapter: str = ""
    """LoRA adapter folder in PEFT's layout (adapter_config.json + adapter_model.safetensors), merged on load."""
    out: str = "completions.jsonl"
    """Where the completions go."""
    batch_size: Annotated[int, at_least(1)] = 8
    """Prompts per generation batch."""
    num_samples: Annotated[int, at_least(1)] = 1
    """Completions per prompt (rows then carry `sample`; score adds best@k and Self-BLEU; compare/elo want 1)."""
    max_new_tokens: Annotated[int, at_least(1)] = 256
    """Most tokens per completion."""
    temperature: Annotated[float, at_least(0, "0 = greedy")] = 0.0
    """0 is greedy decoding (the usual choice for evaluation)."""
    top_p: Annotated[float, within(0, 1, "1 = off", lo_open=True)] = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: Annotated[int, at_least(0, "0 = off")] = 0
    """Keep the k most likely tokens (0 = off)."""
    stop: tuple[str, ...] = ()
    """Stop strings: a completion ends right after the first one it produces (the stop string kept, as in
    training; text its last token carries past it is dropped)."""
    system_prompt: str = ""
    """System message for chat prompts (use the one you trained with)."""
    limit: Annotated[int, at_least(0, "0 = all")] = 0
    """Only the first N rows (0 = all)."""
    seed: Annotated[int, at_least(0)] = 0
    """Sampling seed."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """'auto': bfloat16 on a GPU or a CPU with bf16 units where oneDNN's bf16 path runs, float32 otherwise."""
    device: str = "auto"
    """'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1', ..."""
    plain: bool = False
    """The reading path only, as train.py's --plain: the plain sampler loop on the weights as they are."""
    impl: Literal["auto", "own", "transformers"] = "auto"
    """Which model runs --model, as train.py's --model.impl: nanogrpo's own or transformers' (the plain path)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Episodes instead of single completions, as train.py's --env.* (docs/ENVS.md): rows get `turns`, `env_reward`, `env_info`."""
    allow_user_code: bool = False
    """Let --env.spec import your environment's file."""


@dataclass(frozen=True)
class Score:
    """Score a completions JSONL: per-row metrics (JSONL), a summary table with 95% CIs, and JSON; with
    several samples per prompt (generate --num-samples k) also best@k per metric and Self-BLEU-4."""

    file: Positional[str]
    """Completions JSONL (rows with `completion` and `reference`)."""
    graders: str = "rouge_l"
    """Graders of rewards/ to add to EM/F1/SeqM, comma-separated ('' = none)."""
    target: str = "reference"
    """Row field EM/F1/SeqM compare against ('reference' also uses `references`; 'answer' for short answers)."""
    out: str = ""
    """Per-row scores JSONL ('' = FILE with .scored.jsonl)."""
    json: str = ""
    """Write the summary as JSON to this path ('-' = print it instead of the table)."""
    resamples: Annotated[int, at_least(1)] = 10_000
    """Bootstrap resamples for the CIs."""
    seed: Annotated[int, at_least(0)] = 0
    """Bootstrap seed."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Grader options (answer tag, judge server, ...)."""


@dataclass(frozen=True)
class Compare:
    """Paired comparison of two systems on the same ids (B - A): bootstrap CIs, McNemar on EM; and how many distinct
    answers each gives, with the share of its most common one (--reward.answer-tag reads the answer)."""

    a: Positional[str]
    """Completions (or scored) JSONL of system A, e.g. the base model."""
    b: Positional[str]
    """Completions (or scored) JSONL of system B, e.g. the trained model."""
    graders: str = "rouge_l"
    """Graders added to EM/F1/SeqM when a file has no `scores` (from eval.py score)."""
    target: str = "reference"
    """Row field EM/F1/SeqM compare against."""
    resamples: Annotated[int, at_least(1)] = 10_000
    """Bootstrap resamples."""
    seed: Annotated[int, at_least(0)] = 0
    """Bootstrap seed (the same indices for every metric)."""
    json: str = ""
    """Write the result as JSON to this path ('-' = print it instead of the table)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Grader options."""


@dataclass(frozen=True)
class Elo:
    """Pairwise judging of two or more systems on the same ids, both orders; Bradley-Terry Elo per judge and pooled,
    each variant's mean over judges and runs with min-max bars, and accuracy against Elo."""

    files: Positional[tuple[str, ...]] = ()
    """Completions JSONL of each system (two or more; '.scored.jsonl' files also give the accuracy)."""
    judges: tuple[str, ...] = ("grader:rouge_l",)
    """Judges: 'openai:MODEL' (an LLM at --server.base-url), 'local:PATH', 'grader:NAME', 'em', 'f1', 'seqm'."""
    names: tuple[str, ...] = ()
    """System names, one per file (default: the file names without .jsonl). A name given more than once marks
    runs of one variant: '--names grpo grpo base' rates grpo#1, grpo#2 and base, and grpo as their mean."""
    verdicts: tuple[str, ...] = ()
    """Instead of FILES: OUT_comparisons.jsonl files of earlier elo runs (other judges, or repeated judging
    runs), fitted together without asking any judge again."""
    accuracy: tuple[str, ...] = ()
    """NAME=PATH per system or variant (repeat a variant for its runs): PATH is eval.py score's --json summary or
    .scored.jsonl; draws OUT_accuracy.png (accuracy against Elo). Default: from FILES when they are scored."""
    accuracy_metric: str = "em"
    """The metric of the score files that is the accuracy."""
    accuracy_baseline: str = ""
    """Variant whose accuracy is drawn as a dashed line in OUT_accuracy.png."""
    out: str = "elo"
    """Output prefix: OUT.json (ratings), OUT.png (bars), OUT_comparisons.jsonl (every verdict),
    OUT_accuracy.png (with accuracies)."""
    resamples: Annotated[int, at_least(1)] = 1000
    """Bootstrap resamples over items for the intervals."""
    prior: Annotated[float, above(0, "virtual tied games per pair: keeps every rating finite")] = 1.0
    """Virtual tied games per pair (keeps ratings finite when one system always wins)."""
    seed: Annotated[int, at_least(0)] = 0
    """Bootstrap seed."""
    json: str = ""
    """'-' prints the ratings JSON instead of the table."""
    server: JudgeConfig = field(default_factory=JudgeConfig)
    """Where the openai:/local: judges run (base URL, API key variable, concurrency, retries)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Options of grader: judges."""


@dataclass(frozen=True)
class Report:
    """(Re)draw RUN's plots (*.png) and (re)write RUN/index.html, the static run page that embeds them; with
    several runs and --out, one page overlaying their curves."""

    runs: Positional[tuple[str, ...]]
    """Run folder(s) (config.json, metrics.jsonl, samples.jsonl)."""
    max_sample_steps: Annotated[int, at_least(2, "the first logged step and the latest")] = 60
    """Most logged steps of samples on the page (the first and the latest are kept)."""
    out: str = ""
    """Where to write the page: RUN/index.html by default for one run; needed for several runs."""


def _emit(obj: dict, path: str, table: str) -> None:
    """Print the table, or the JSON when path is '-'; write the JSON when path is a file."""
    text = json.dumps(obj, indent=2)
    if path == "-":
        print(text)
        return
    print(table)
    if path:
        Path(path).write_text(text + "\n")
        print(f"wrote {path}")


def run_generate(args: Generate) -> None:
    from nanogrpo.data import load_task

    out = output_file(args.out, "--out")  # '' or a folder there: refused before the model loads
    if (meta := provenance.meta_path(out)).is_dir():  # where its settings go
        raise ValueError(
            f"{meta} is a folder, where generate records how --out was made: remove it or change --out"
        )
    rows = load_task(args.data, "eval")[0]  # validated before any model is loaded
    rows = rows[: args.limit] if args.limit else rows
    # --env.*: the environment, checked and one instance built, before the model (None without one)
    env = resolve_env(args.env, args.max_new_tokens, args.allow_user_code, "--allow-user-code")
    model, tokenizer = generation.load_model(
        args.model, args.adapter, args.dtype, args.device, args.impl, args.plain
    )
    if env is not None:  # the template, a reset on the first row and its first message's length
        n = model.config.max_position_embeddings
        env = check_start(env, tokenizer, rows, args.system_prompt, n - env.max_tokens, n, args.batch_size * args.num_samples, "plain")  # fmt: skip
    episodes: list[dict] = []  # with --env: each episode's transcript, reward and info
    with closing(env.workers) if env else nullcontext():  # its processes, and all they started, end here
        outs = generation.generate_completions(
            model, tokenizer, rows, batch_size=args.batch_size, num_samples=args.num_samples,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            stop=args.stop, system_prompt=args.system_prompt, seed=args.seed, env=env, episodes=episodes,
        )  # fmt: skip
    recs = [
        {**r, "completion": c, **({"sample": k} if args.num_samples > 1 else {})}
        for r, cs in zip(rows, outs)
        for k, c in enumerate(cs)
    ]
    for rec, e in zip(recs, episodes):  # the env graders of `eval.py score` read these columns
        rec.update({k: e[k] for k in ("turns", "env_reward", "env_info")})
    write_or_keep(out, jsonl_text(recs), "the completions")  # a late failure keeps them beside --out
    # how the file was made, and the training run it comes from (for the same-judge warning)
    meta = provenance.write_meta(
        args.out, data=args.data, model=args.model, adapter=args.adapter, num_samples=args.num_samples,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, plain=args.plain,
    )  # fmt: skip
    print(f"wrote {len(recs)} completions to {args.out} (settings in {meta})")


def run_score(args: Score) -> None:
    out = output_file(args.out or str(Path(args.file).with_suffix("")) + ".scored.jsonl", "--out")  # first
    rows = evaluate.read_jsonl(args.file)
    scores = evaluate.score_rows(
        rows, graders=args.graders, reward_cfg=args.reward, target=args.target, path=args.file
    )
    write_or_keep(out, jsonl_text({**r, "scores": s} for r, s in zip(rows, scores)), "the scores")
    summary = evaluate.summarise(scores, args.resamples, args.seed)
    table = evaluate.format_summary_table(summary) + f"\n({len(rows)} rows; per-row scores in {out})"
    result = {"file": args.file, "n": len(rows), "metrics": summary}
    samples = evaluate.samples_summary(rows, scores, args.resamples, args.seed)  # k samples per prompt
    if samples is not None:
        result["samples"] = samples
        table += "\n\n" + evaluate.format_samples_table(samples)
    _emit(result, args.json, table)
    graders = provenance.grader_names(args.graders)
    provenance.warn_same_judge([args.file], graders, provenance.eval_judges(graders, args.reward))


def run_grade(args: GradeArgs) -> None:
    code = rewards_grade.run(args)  # rows on stdout, the agreement report on stderr
    if code:
        sys.exit(code)


def _scores(rows: list[dict], args: Compare) -> list[dict]:
    if all(isinstance(r.get("scores"), dict) for r in rows):
        return [r["scores"] for r in rows]
    return evaluate.score_rows(rows, graders=args.graders, reward_cfg=args.reward, target=args.target)


def _by_id(path: str) -> dict:
    rows = evaluate.read_jsonl(path)
    by = {r["id"]: r for r in rows}
    if len(by) != len(rows):
        raise ValueError(
            f"{path}: ids repeat; compare and elo pair one completion per id (generate with --num-samples 1)"
        )
    return by


def run_compare(args: Compare) -> None:
    a, b = _by_id(args.a), _by_id(args.b)
    ids = [i for i in a if i in b]
    if not ids:
        raise ValueError(f"{args.a} and {args.b} share no ids: compare completions of the same held-out file")
    sa, sb = _scores([a[i] for i in ids], args), _scores([b[i] for i in ids], args)
    summary = evaluate.paired_summary(sa, sb, seed=args.seed, n_resamples=args.resamples)
    names = (Path(args.a).stem, Path(args.b).stem)
    dropped = len(set(a) ^ set(b))
    table = (
        evaluate.format_paired_table(summary, names)
        + f"\n({len(ids)} paired ids"
        + (f", {dropped} ids in only one file dropped" if dropped else "")
        + f"; diff = {names[1]} - {names[0]}; paired bootstrap, {args.resamples} resamples, seed {args.seed};"
        " * = CI excludes 0)"
    )
    # a gain can be one answer to every question that is often right: each system's distinct answers
    answers = [
        evaluate.answer_summary([r[i].get("completion", "") for i in ids], args.reward) for r in (a, b)
    ]
    shown = names if names[0] != names[1] else ("A", "B")  # two files of one name
    table += "\n" + evaluate.format_answers(dict(zip(shown, answers)))
    result = {"a": args.a, "b": args.b, "n": len(ids), "resamples": args.resamples, "seed": args.seed}
    _emit({**result, "metrics": summary, "answers": dict(zip("ab", answers))}, args.json, table)
    graders = [m for m in summary if m not in evaluate.ANSWER_METRICS]  # the graders behind the scores
    provenance.warn_same_judge([args.a, args.b], graders, provenance.eval_judges(graders, args.reward))


def _system_names(args: Elo) -> list[str]:
    """One name per file; a name given more than once is a variant's runs: grpo, grpo -> grpo#1, grpo#2."""
    if not args.names:
        names = [Path(f).name.removesuffix(".jsonl") for f in args.files]
        if len(set(names)) != len(names):
            raise ValueError(
                f"files of the same name {names}: pass --names (repeat a name for runs of one variant)"
            )
        return names
    if len(args.names) != len(args.files):
        raise ValueError(f"{len(args.names)} --names for {len(args.files)} files: give one name per file")
    count, seen = Counter(args.names), Counter()
    out = []
    for n in args.names:
        seen[n] += 1
        out.append(f"{n}#{seen[n]}" if count[n] > 1 else n)
    return out


def _accuracies(args: Elo, systems: dict[str, list[dict]], names: list[str]) -> dict[str, list[float]]:
    """{system or variant: [accuracy of each run]} from --accuracy, else from scored FILES; {} when neither."""
    known = set(names) | {pairwise.variant_of(n) for n in names}
    if args.accuracy_baseline and args.accuracy_baseline not in known:
        raise ValueError(
            f"--accuracy-baseline {args.accuracy_baseline!r} is not a variant of {sorted(known)}"
        )
    if args.accuracy:
        out: dict[str, list[float]] = {}
        for item in args.accuracy:
            name, sep, path = item.partition("=")
            if name not in known and pairwise.variant_of(name) not in known:
                raise ValueError(
                    f"--accuracy {item!r}: {name!r} is not a system or variant of {sorted(known)}"
                )
            if not sep or not name or not path:
                raise ValueError(
                    f"--accuracy {item!r}: write NAME=PATH, e.g. grpo=runs/grpo/trained_summary.json"
                )
            out.setdefault(name, []).append(pairwise.read_accuracy(path, args.accuracy_metric))
        return out
    m = args.accuracy_metric
    if systems and all(
        isinstance(r.get("scores"), dict) and r["scores"].get(m) is not None
        for rs in systems.values()
        for r in rs
    ):
        ids = set(pairwise.align(systems))
        return {
            n: [sum(r["scores"][m] for r in rs if r["id"] in ids) / len(ids)] for n, rs in systems.items()
        }
    return {}


def run_elo(args: Elo) -> None:
    if not args.out.strip():  # the prefix of every file written: '' would write _comparisons.jsonl here
        raise ValueError("--out '': name the output prefix (e.g. --out runs/elo)")
    systems: dict[str, list[dict]] = {}
    comparisons = Path(f"{args.out}_comparisons.jsonl")
    if args.verdicts:  # refit earlier verdicts: no judge is asked
        if args.files or args.names:
            raise ValueError(
                "give completions FILES to judge, or --verdicts to refit earlier verdicts, not both"
            )
        if any(Path(v).resolve() == comparisons.resolve() for v in args.verdicts):
            raise ValueError(
                f"--out {args.out} would overwrite the verdicts file {comparisons}: pass another --out"
            )
        records = pairwise.load_verdicts(args.verdicts)
        names = pairwise.systems_of(records)
        acc = _accuracies(args, systems, names)
    else:
        if len(args.files) < 2:
            raise ValueError(
                "elo needs two or more completions files (or --verdicts files of earlier elo runs)"
            )
        names = _system_names(args)
        systems = {n: list(_by_id(f).values()) for n, f in zip(names, args.files)}
        if not pairwise.align(systems):
            raise ValueError("the files share no ids: judge completions of the same held-out file")
        acc = _accuracies(args, systems, names)  # a bad --accuracy stops before any judge is asked
        graders = [j.partition(":")[2] for j in args.judges if j.startswith("grader:")]
        models = [j.partition(":")[2] for j in args.judges if j.startswith(("openai:", "local:"))]
        provenance.warn_same_judge(
            list(args.files), graders, models + provenance.eval_judges(graders, args.reward)
        )
        pairwise.check_judges(args.judges, args.server, args.reward)  # a judge server that is down: stop now
        judges = {j: pairwise.make_judge(j, args.server, args.reward) for j in args.judges}
        records = pairwise.run_pairwise(systems, judges)
    write_jsonl(comparisons, records)
    rep = pairwise.elo_report(records, names, args.resamples, args.seed, args.prior)
    wrote = [f"{args.out}.json", str(elo_plots.plot_elo(rep, f"{args.out}.png")), str(comparisons)]
    if acc:
        rep["accuracy"] = pairwise.accuracy_report(acc, rep, args.accuracy_metric)
        png = elo_plots.plot_accuracy_vs_elo(
            rep["accuracy"], f"{args.out}_accuracy.png", args.accuracy_baseline
        )
        wrote.append(str(png))
    Path(f"{args.out}.json").parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(rep, indent=2) + "\n")
    table = pairwise.format_elo_table(rep) + f"\nwrote {', '.join(wrote)}"
    _emit(rep, "-" if args.json == "-" else "", table)


def run_report(args: Report) -> None:
    if not args.runs:
        raise ValueError("name a run folder: python eval.py report RUN (or RUN1 RUN2 ... --out FILE.html)")
    if len(args.runs) == 1:
        print(report.write_report(args.runs[0], args.max_sample_steps, args.out or None))
    elif not args.out:
        raise ValueError(f"{len(args.runs)} runs: name the overlay page with --out FILE.html")
    else:
        print(overlay.write_overlay(list(args.runs), args.out))


COMMANDS = {
    "generate": Generate,
    "score": Score,
    "grade": GradeArgs,
    "compare": Compare,
    "elo": Elo,
    "report": Report,
    "seeds": seeds_cli.SeedsArgs,
    "seeds-table": seeds_cli.TableArgs,
}
RUNNERS = {
    Generate: run_generate,
    Score: run_score,
    GradeArgs: run_grade,
    Compare: run_compare,
    Elo: run_elo,
    Report: run_report,
    seeds_cli.SeedsArgs: seeds_cli.run_seeds_cli,
    seeds_cli.TableArgs: seeds_cli.run_table_cli,
}


def run(argv: list[str] | None = None) -> int:
    """`python eval.py COMMAND ARGS`: 0 when it ends; bad data or flags: one clear line on stderr (no
    traceback) and 2, as train.py (a number outside the range on its field too)."""
    args = tyro.extras.subcommand_cli_from_dict(COMMANDS, description=__doc__.split("\n\n")[0], args=argv)
    try:
        check_ranges(args)
        RUNNERS[type(args)](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run())
