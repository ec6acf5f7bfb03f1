"""Small-LM Judges's comparison of three readouts of one frozen LM as a rubric judge, side by side on labels.

    python -m nanogrpo.eval.probe compare --data labels.jsonl --model smollm2 --out runs/readouts
    python -m nanogrpo.eval.probe compare --data labels.jsonl --model smollm2 --folds 5 --rubrics rubrics.jsonl \
        --probe-pool mean --out runs/readouts-mean

Input: the rows `python -m nanogrpo.reward_data label` writes, {"prompt", "response", "criterion",
"label": 0|1}, with optional "split" ("train" / "dev" / "test") and "weight" (the criterion's rubric
weight; or give the rubric rows with --rubrics). Every readout asks the same question of the same model, the rubric
judge's Yes/No question (rewards.rubric.criterion_messages):

- generative: the model replies (greedy) and a reply starting with Yes means met (rewards.rubric's
  'generative' readout on the local judge backend). A reply that is neither Yes nor No counts as a
  wrong verdict, as the paper counts a judge's parse failures; the JSON gives how many there were.
- logprob: from the first reply token's top alternatives, met when log P(Yes) - log P(No) > 0
  (rewards.rubric's 'logprob' readout); `logprob-tuned` is the same margin with the threshold that has
  the best macro-F1 on the rows not held out (train and dev: the threshold is its only parameter).
- probe: a linear probe (rewards.probe.fit_probe) fitted on the train rows' hidden states, layer and
  threshold chosen on the dev rows, as Small-LM Judges; --probe-* set the paper's variants.

Splits go by question (prompt), so no question is in two of them: the rows' own 'split' fields when
every row has one, else a seeded split (--test-frac, --dev-frac of the questions). With --folds K
every question is held out once instead (K-fold cross-fitting: a probe and a tuned threshold per fold,
fitted on the other folds; 'split' fields are then not read), which uses all of a small label set;
the paper uses one fixed split.

Scores, on the held-out rows, per value of --by (the criterion by default) and overall:
- macro-F1: the mean F1 of the two classes (met, not met), as rewards.probe.macro_f1; 'overall' pools
  every held-out decision (it is not the mean of the per-criterion scores).
- weighted accuracy: the paper's summary reports "weighted criterion accuracy" without a definition;
  we read it as each decision weighted by its criterion's rubric weight, sum |w| [verdict = label] /
  sum |w| (a pitfall at weight -2 counts 2). It is not class-balanced accuracy (that is in the JSON as
  balanced_accuracy). Without weights it is plain accuracy, and the JSON says so.
- 95% intervals: a paired bootstrap over questions (all the decisions of a resampled question go
  together, since they share a prompt and a response), the same resampled questions for every readout
  (nanogrpo.eval.stats.bootstrap_means); both metrics are ratios of sums of per-decision counts, so each
  resample's metrics come from its mean counts, and the interval of a difference is the percentile
  interval of the resampled differences.

Departures: the generative reply is at most 8 tokens and the logprob alternatives are the top 20 (the
rubric grader's settings); mean pooling and layer averaging are fitted as the default probe is (L2
logistic regression, L-BFGS), and the paper's MLP heads are not offered.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanogrpo.eval.label_rows import SPLITS, assign_folds, read_label_rows
from nanogrpo.eval.readout_scores import METRICS, paired_bootstrap, scores
from nanogrpo.infra.outputs import output_folder

READOUTS = ("generative", "logprob", "probe")

# ----------------------------------------------------------------------------- readouts


def judge_verdicts(
    rows: Sequence[dict[str, Any]], readout: str, client: Any, judge_cfg: Any, chunk: int = 16
) -> tuple[list[float | None], dict[str, float]]:
    """P(met) per row from rewards.rubric's generative (0/1) or logprob (P(Yes) / (P(Yes) + P(No)))
    readout; None where the reply gave no verdict. Each row is one one-criterion rubric."""
    from rewards.base import Sample
    from rewards.options import RewardConfig, RubricConfig
    from rewards.rubric import Rubric

    cfg = RewardConfig(judge=judge_cfg, rubric=RubricConfig(readout=readout, soft=True))
    grader = Rubric(cfg, client=client)
    out: list[float | None] = []
    totals: dict[str, float] = {}
    t0 = time.perf_counter()
    for i in range(0, len(rows), chunk):
        batch = [
            Sample(r["prompt"], r["response"], row={"rubric": [{"criterion": r["criterion"], "weight": 1}]})
            for r in rows[i : i + chunk]
        ]
        grader.score(batch)
        out += [d["criteria"][0]["verdict"] if d else None for d in grader.last_details]
        for k, v in grader.metrics().items():
            totals[k] = totals.get(k, 0.0) + v
        _log(f"{readout}: {len(out)}/{len(rows)} rows, {time.perf_counter() - t0:.0f} s")
    return out, totals


def parse_layer(spec: str, n_states: int) -> tuple[list[int] | None, int]:
    """--probe-layer -> (candidate layers, how many last layers to average): 'dev' -> (None, 0), every
    layer tried on dev; '7' or '-1' -> ([that layer], 0); 'last4' -> ([0], 4), the mean of the last 4."""
    if spec == "dev":
        return None, 0
    if spec.startswith("last") and spec[4:].isdigit() and 1 <= int(spec[4:]) <= n_states - 1:
        return [0], int(spec[4:])
    try:
        k = int(spec)
    except ValueError:
        k = None
    if k is None or not -n_states <= k < n_states:
        raise ValueError(
            f"--probe-layer must be 'dev', a layer from {-n_states} to {n_states - 1} (0 the embeddings, -1 the "
            f"last layer) or 'lastK' with K from 1 to {n_states - 1} (the mean of the last K layers), got {spec!r}"
        )
    return [k % n_states], 0


def probe_verdicts(
    xs: Any, rows: Sequence[dict[str, Any]], parts: Sequence[dict[str, list[int]]], layer: str, l2: float,
    threshold: str,
) -> tuple[list[float | None], list[int | None], list[dict[str, Any]]]:  # fmt: skip
    """P(met) and verdict of each held-out row from its fold's probe, and each fold's layer and threshold."""
    from rewards.probe import fit_probe

    layers, avg = parse_layer(layer, xs.shape[0])
    if avg:
        xs = xs[-avg:].mean(0, keepdim=True)  # (1, N, H): the last `avg` layers' states averaged
    fixed = None
    if threshold != "dev":
        try:
            fixed = float(threshold)
        except ValueError:
            fixed = -1.0
        if not 0 < fixed < 1:
            raise ValueError(
                f"--probe-threshold must be 'dev' or a probability in (0, 1), e.g. 0.5; got {threshold!r}"
            )
    label = [int(r["label"]) for r in rows]
    p: list[float | None] = [None] * len(rows)
    pred: list[int | None] = [None] * len(rows)
    fits = []
    for f, part in enumerate(parts):
        for s in ("train", "dev"):
            if len({label[i] for i in part[s]}) < 2:
                raise ValueError(
                    f"fold {f}: the probe's {s} rows need both labels (met and not met); give more questions, "
                    "fewer --folds or a 'split' on every row"
                )
        tr, dev, test = part["train"], part["dev"], part["test"]
        probe, losses, _ = fit_probe(xs[:, tr], [label[i] for i in tr], xs[:, dev], [label[i] for i in dev],
                                     l2=l2, layers=layers, tune_threshold=fixed is None)  # fmt: skip
        if fixed is not None:
            probe.threshold = fixed
        for i, q in zip(test, probe.proba_features(xs[probe.layer, test])):
            p[i], pred[i] = q, int(q >= probe.threshold)
        chosen = f"mean of the last {avg}" if avg else probe.layer
        fits.append({"fold": f, "layer": chosen, "threshold": probe.threshold, "dev_log_loss": min(losses)})
    return p, pred, fits


def tuned_margin(p: Sequence[float | None], label: Sequence[int], idx: Sequence[int]) -> float:
    """The P(Yes) / (P(Yes) + P(No)) threshold with the best macro-F1 on rows `idx` (0.5: margin 0)."""
    from rewards.probe import best_threshold

    have = [i for i in idx if p[i] is not None]
    if len({label[i] for i in have}) < 2:
        return 0.5  # nothing to tune on: the untuned margin 0
    return best_threshold([p[i] for i in have], [label[i] for i in have])


def hard(p: float | None, threshold: float, label: int) -> int:
    """The verdict at `threshold`; no verdict counts as the wrong one (the paper's parse failures)."""
    return 1 - label if p is None else int(p >= threshold)


# ----------------------------------------------------------------------------- the command


def check_choices(readouts: tuple[str, ...], probe_pool: str, dtype: str) -> None:
    """compare's flags that take one of a few names."""
    from rewards.probe import POOLS

    unknown = [r for r in readouts if r not in READOUTS]
    if unknown or not readouts:
        raise ValueError(f"--readouts takes {', '.join(READOUTS)}; got {', '.join(readouts) or 'none'}")
    if probe_pool not in POOLS:
        raise ValueError(f"--probe-pool must be one of {', '.join(POOLS)}, got {probe_pool!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, got {dtype!r}")


def compare(
    data: str, model: str, out: str = "readouts", readouts: tuple[str, ...] = READOUTS, by: str = "criterion",
    rubrics: tuple[str, ...] = (), folds: int = 0, test_frac: float = 0.3, dev_frac: float = 0.2, seed: int = 0,
    probe_layer: str = "dev", probe_pool: str = "last", probe_l2: float = 1e-3, probe_threshold: str = "dev",
    resamples: int = 10_000, batch_size: int = 8, device: str = "cpu", dtype: str = "float32", max_len: int = 2048,
) -> dict[str, Any]:  # fmt: skip
    """Score the generative, log-prob and probe readouts of one frozen LM on labelled rows, side by side.

    Prints a table (criteria x readouts: macro-F1 and weighted accuracy on the held-out rows) and the
    overall differences with paired bootstrap 95% intervals; writes readouts.json and predictions.jsonl.

    Args:
        data: Label rows {"prompt", "response", "criterion", "label"} (python -m nanogrpo.reward_data label), optional
            "split" (train/dev/test) and "weight".
        model: The frozen LM of every readout: 'tiny', 'smollm2' or an HF folder.
        out: Folder for readouts.json, predictions.jsonl and the judge cache (a rerun reuses the verdicts).
        readouts: Which to run: generative, logprob (also gives logprob-tuned), probe.
        by: Row field whose values make the table's rows ('criterion'; 'prompt' for per question).
        rubrics: Rubric rows ({"prompt", "rubric"}) giving each criterion's weight for weighted accuracy.
        folds: 0: one train/dev/test split; K >= 2: every question held out once, K probes.
        test_frac: Share of the questions held out for testing (one split, rows without 'split').
        dev_frac: Share of the remaining questions for the probe's layer and threshold.
        seed: Seed of the splits and the bootstrap.
        probe_layer: 'dev' (chosen on dev, the paper's), a layer (0 the embeddings, -1 the last) or 'lastK'
            (the mean of the last K layers' states).
        probe_pool: 'last' (the last token's hidden state, the paper's) or 'mean' (averaged over the text).
        probe_l2: L2 penalty of the probe's logistic regression (sklearn's C = 1 / (l2 x train rows)).
        probe_threshold: 'dev' (best dev macro-F1, the paper's) or a fixed P(met), e.g. 0.5.
        resamples: Bootstrap resamples.
        batch_size: Texts per forward pass of the probe's LM.
        device: 'cpu' or 'cuda'.
        dtype: 'float32' or 'bfloat16', of both the judge and the probe's LM.
        max_len: Longest probe input in tokens (longer ones keep their end).
    """
    from nanogrpo import judge_backend
    from nanogrpo.infra.flag_checks import PROBE_COMPARE
    from nanogrpo_base.ranges import check_ranges
    from rewards.local_client import resolve_model
    from rewards.options import JudgeConfig
    from rewards.probe_cli import check_data, check_device

    check_ranges(locals(), PROBE_COMPARE)  # the flags' numbers, first
    check_choices(readouts, probe_pool, dtype)
    check_data(data)  # then the labels file, the device and --out: before any model loads
    check_device(device)
    outdir = output_folder(out, "--out")  # '' (here) or a file: refused; a rerun reuses its judge cache
    rows = read_label_rows(data, rubrics)
    if any(by not in r for r in rows):
        raise ValueError(
            f"--by {by!r}: not a field of every row; use criterion, prompt or a field they all have"
        )
    parts = assign_folds(rows, folds, test_frac, dev_frac, seed)
    judge_backend.register()  # model names ('tiny', 'smollm2') for the judge and the probe's LM
    resolve_model(model)  # a bad name or folder stops here, before any model loads
    test = sorted(i for part in parts for i in part["test"])
    outdir.mkdir(parents=True, exist_ok=True)
    p: dict[str, list[float | None]] = {}
    pred: dict[str, list[int | None]] = {}
    info: dict[str, Any] = {"seconds": {}}

    if "generative" in readouts or "logprob" in readouts:
        jcfg = JudgeConfig(backend="local", model=model, device=device, dtype=dtype,
                           cache=str(outdir / "judge_cache.jsonl"))  # fmt: skip
        judge_readouts(rows, readouts, parts, folds, jcfg, p, pred, info)
    if "probe" in readouts:
        probe_readout(rows, parts, model, device, dtype, max_len, batch_size, p, pred, info,
                      layer=probe_layer, pool=probe_pool, l2=probe_l2, threshold=probe_threshold)  # fmt: skip
    order = [c for c in ("generative", "logprob", "logprob-tuned", "probe") if c in pred]
    weighted = any(r["weight"] != 1.0 for r in rows)
    report = {
        "data": data, "model": model, "rows": len(rows), "questions": len({r["prompt"] for r in rows}),
        "held_out": len(test), "by": by, "columns": order,
        "split": {"folds": folds} if folds else {s: len(parts[0][s]) for s in SPLITS},
        "weights": "rubric |w|" if weighted else "none: weighted accuracy is plain accuracy",
        **info, "results": grouped_results(rows, pred, order, test, by, resamples, seed),
    }  # fmt: skip
    write_readouts(outdir, report, rows, parts, p, pred)
    print(format_table(report))
    print(f"written: {outdir / 'readouts.json'}, {outdir / 'predictions.jsonl'}")
    return report


def judge_readouts(
    rows: list[dict],
    readouts: Sequence[str],
    parts: list[dict],
    folds: int,
    jcfg,
    p: dict,
    pred: dict,
    info: dict,
) -> None:
    """The generative and logprob readouts through the local judge (and logprob-tuned, a threshold per fold
    fitted on the rows not held out): each one's P(met) into p, its verdicts into pred, counts into info."""
    from rewards.llm_client import make_client

    label = [int(r["label"]) for r in rows]
    test = sorted(i for part in parts for i in part["test"])
    client = make_client(jcfg)
    for name in ("generative", "logprob"):
        if name not in readouts:
            continue
        # logprob-tuned fits its threshold on the rows not held out: those are scored too
        todo = test if name == "generative" and folds == 0 else list(range(len(rows)))
        t0 = time.perf_counter()
        got, counts = judge_verdicts([rows[i] for i in todo], name, client, jcfg)
        info["seconds"][name] = time.perf_counter() - t0
        p[name] = [None] * len(rows)
        for i, v in zip(todo, got):
            p[name][i] = v
        info[name] = {
            "unparsed": sum(p[name][i] is None for i in test),
            "calls": counts.get("calls", 0.0),
        }
    if "logprob" in readouts:
        p["logprob-tuned"] = p["logprob"]
        info["logprob-tuned"] = {"thresholds": []}
        pred["logprob-tuned"] = [None] * len(rows)
        for part in parts:
            t = tuned_margin(p["logprob"], label, part["train"] + part["dev"])
            info["logprob-tuned"]["thresholds"].append({"p_yes": t, "margin": math.log(t / (1 - t))})
            for i in part["test"]:
                pred["logprob-tuned"][i] = hard(p["logprob"][i], t, label[i])
    held = set(test)
    for name in ("generative", "logprob"):
        if name in p:
            pred[name] = [hard(p[name][i], 0.5, label[i]) if i in held else None for i in range(len(rows))]


def probe_readout(
    rows: list[dict], parts: list[dict], model: str, device: str, dtype: str, max_len: int, batch_size: int,
    p: dict, pred: dict, info: dict, *, layer: str, pool: str, l2: float, threshold: str,
) -> None:  # fmt: skip
    """The probe readout: every row's hidden states once, then a probe per fold (probe_verdicts); its P(met)
    into p, its verdicts into pred, the fits and timings into info."""
    from rewards.probe import FrozenLM

    t0 = time.perf_counter()
    lm = FrozenLM(model, device=device, dtype=dtype, max_len=max_len)
    xs = lm.features(rows, batch_size=batch_size, pool=pool)  # (L+1, N, H): every row once
    info["seconds"]["probe_features"] = time.perf_counter() - t0
    _log(f"probe: hidden states of {len(rows)} rows, {info['seconds']['probe_features']:.0f} s")
    t0 = time.perf_counter()
    p["probe"], pred["probe"], fits = probe_verdicts(xs, rows, parts, layer, l2, threshold)
    info["seconds"]["probe_fit"] = time.perf_counter() - t0
    info["probe"] = {"layer": layer, "pool": pool, "l2": l2, "threshold": threshold, "folds": fits}


def grouped_results(
    rows: list[dict], pred: dict, order: list[str], test: list[int], by: str, resamples: int, seed: int
) -> dict[str, dict]:
    """Per value of `by` and 'overall': the held-out rows' scores of each readout, with the paired
    bootstrap's intervals and differences."""
    label = [int(r["label"]) for r in rows]
    groups = {"overall": test} | {
        str(v): [i for i in test if str(rows[i][by]) == v]
        for v in dict.fromkeys(str(rows[i][by]) for i in test)
    }
    results = {}
    for g, idx in groups.items():
        res = paired_bootstrap({c: [pred[c][i] for i in idx] for c in order}, [label[i] for i in idx],
                               [rows[i]["weight"] for i in idx], [rows[i]["prompt"] for i in idx],
                               n_resamples=resamples, seed=seed)  # fmt: skip
        for c in order:
            full = scores(
                [pred[c][i] for i in idx], [label[i] for i in idx], [rows[i]["weight"] for i in idx]
            )
            res["readouts"][c].update(accuracy=full["accuracy"], balanced_accuracy=full["balanced_accuracy"])
        results[g] = {"n": len(idx), "met": sum(label[i] for i in idx), **res}
    return results


def write_readouts(
    outdir: Path, report: dict, rows: list[dict], parts: list[dict], p: dict, pred: dict
) -> None:
    """readouts.json (the report) and predictions.jsonl (each held-out row's P(met) and verdict per readout)."""
    order = report["columns"]
    fold_of = {i: f for f, part in enumerate(parts) for i in part["test"]}
    (outdir / "readouts.json").write_text(json.dumps(report, indent=2) + "\n")
    with (outdir / "predictions.jsonl").open("w", encoding="utf-8") as fh:
        # the verdict as read: null where the reply gave none (scored as the wrong verdict)
        verdict = {c: [None if p[c][i] is None else pred[c][i] for i in range(len(rows))] for c in order}
        for i in sorted(fold_of):
            fh.write(json.dumps({"row": i, "fold": fold_of[i], "prompt": rows[i]["prompt"],
                                 "criterion": rows[i]["criterion"], "label": int(rows[i]["label"]),
                                 "weight": rows[i]["weight"], "p": {c: p[c][i] for c in order},
                                 "verdict": {c: verdict[c][i] for c in order}}) + "\n")  # fmt: skip


def format_table(report: dict[str, Any], width: int = 44) -> str:
    """The criteria x readouts table of macro-F1 and weighted accuracy, then the overall differences."""
    cols, res = report["columns"], report["results"]
    head = f"{report['by'][:width]:<{width}} {'n':>4}  " + "  ".join(f"{c:>13}" for c in cols)
    sub = f"{'':<{width}} {'':>4}  " + "  ".join(f"{'F1':>6} {'w-acc':>6}" for _ in cols)
    lines = [head, sub]
    for g, r in res.items():
        name = " ".join(g.split())  # a prompt (--by prompt) may span lines
        name = name if len(name) <= width else name[: width - 3] + "..."
        vals = "  ".join(
            f"{r['readouts'][c]['macro_f1']['value']:6.3f} {r['readouts'][c]['weighted_accuracy']['value']:6.3f}"
            for c in cols
        )
        lines.append(f"{name:<{width}} {r['n']:>4}  {vals}")
    o = res["overall"]
    if o["differences"]:
        lines.append("")
        lines.append(
            f"overall differences, paired bootstrap {o['level']:.0%} CI over {o['clusters']} questions "
            f"({o['resamples']} resamples):"
        )
        for pair, d in o["differences"].items():
            cells = [f"{m} {d[m]['diff']:+.3f} [{d[m]['ci'][0]:+.3f}, {d[m]['ci'][1]:+.3f}]" for m in METRICS]
            lines.append(f"  {pair:<28} " + "   ".join(cells))
    return "\n".join(lines)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
