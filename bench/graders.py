"""Benchmarks of the graders on the CPU: ROUGE-L pairs/s against the `rouge-score` package, and semantic
reward completions/s. Prints a table last, then the command that reproduces it.

    python bench/graders.py                 # 1,000 pairs of 512 tokens; 256 semantic completions
    python bench/graders.py --smoke         # tiny sizes: checks that the script runs

ROUGE-L is timed end to end as the trainer calls it: `rewards.rouge.rouge_l` on strings (tokenising,
word ids, then nanogrpo_kernels.lcs.lcs_lengths for the whole batch). The `rouge-score` package (Google's
reference implementation, pure Python dynamic programming) is NOT a nanogrpo dependency; install it
into the environment for this benchmark only:

    pip install rouge-score

It is slow (tens of ms per 512-token pair), so it runs on the first --ref-pairs pairs and its rate is
per pair; both sides use the same texts, and the script checks the two F1 values agree on them
(rouge-score without stemming; the texts are ASCII words, where both tokenisers split alike).

The semantic rate is `rewards.semantic` on --semantic completions of --semantic-words words, G=8
completions per reference (references are embedded once and cached, as in training), after a warm-up
call; the model load time is reported separately.
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rewards import RewardConfig, Sample, make  # noqa: E402
from rewards.rouge import rouge_l  # noqa: E402


def make_pairs(n: int, tokens: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """n (answer, reference) pairs of `tokens` words: the answer edits ~30% of the reference's words,
    so the LCS is long (the expensive case for bit-parallel LCS is the same as for the DP)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    answers, refs = [], []
    for _ in range(n):
        ref = [rng.choice(vocab) for _ in range(tokens)]
        ans = [w if rng.random() > 0.3 else rng.choice(vocab) for w in ref]
        refs.append(" ".join(ref))
        answers.append(" ".join(ans))
    return answers, refs


def best_of(fn, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_rouge(args) -> dict:
    answers, refs = make_pairs(args.pairs, args.tokens)
    t_ours = best_of(lambda: rouge_l(answers, refs), args.reps)
    out = {"pairs": args.pairs, "tokens": args.tokens, "ours_pairs_per_s": args.pairs / t_ours}
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        print("rouge-score is not installed (pip install rouge-score): timing nanogrpo only", file=sys.stderr)
        return out
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    k = min(args.ref_pairs, args.pairs)
    t0 = time.perf_counter()
    theirs = [scorer.score(r, a)["rougeL"].fmeasure for a, r in zip(answers[:k], refs[:k])]
    t_ref = time.perf_counter() - t0
    ours = rouge_l(answers[:k], refs[:k])
    out.update(
        ref_pairs=k,
        rouge_score_pairs_per_s=k / t_ref,
        speedup=(args.pairs / t_ours) / (k / t_ref),
        max_abs_diff=max(abs(a - b) for a, b in zip(ours, theirs)),
    )
    return out


def bench_semantic(args) -> dict:
    t0 = time.perf_counter()
    g = make("semantic", RewardConfig(semantic_device="cpu", semantic_batch_size=args.semantic_batch))
    g([Sample("p", "warm up", 0, {"reference": "warm up"})])  # loads the model
    t_load = time.perf_counter() - t0
    rng = random.Random(1)
    words = "the of cell energy heart blood acid water cost rate report share answer reason model".split()
    n, G = args.semantic, 8
    refs = [" ".join(rng.choice(words) for _ in range(args.semantic_words)) for _ in range(max(1, n // G))]
    batch = [
        Sample(
            "p",
            " ".join(rng.choice(words) for _ in range(args.semantic_words)),
            i // G,
            {"reference": refs[i // G % len(refs)]},
        )
        for i in range(n)
    ]
    t = best_of(lambda: g(batch), args.reps)
    return {"completions": n, "words": args.semantic_words, "completions_per_s": n / t, "load_s": t_load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--ref-pairs", type=int, default=100, help="pairs timed with rouge-score (slow)")
    p.add_argument("--semantic", type=int, default=256, help="completions for the semantic rate")
    p.add_argument("--semantic-words", type=int, default=100)
    p.add_argument("--semantic-batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: check that the script runs")
    p.add_argument("--out", default="", help="also write the results as JSON to this file")
    args = p.parse_args()
    if args.smoke:
        args.pairs, args.tokens, args.ref_pairs, args.semantic, args.reps = 20, 64, 5, 16, 1

    import torch

    rouge = bench_rouge(args)
    sem = bench_semantic(args) if args.semantic > 0 else {}
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    res = {"date": time.strftime("%Y-%m-%d"), "machine": machine, "rouge_l": rouge, "semantic": sem}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")

    print(f"\n{res['date']} | {machine} | python {platform.python_version()}")
    print("| measure | nanogrpo | rouge-score | ratio |\n|---|---|---|---|")
    ref = f"{rouge['rouge_score_pairs_per_s']:,.1f}" if "speedup" in rouge else "n/a"
    ratio = f"{rouge['speedup']:,.0f}x" if "speedup" in rouge else "n/a"
    print(
        f"| ROUGE-L pairs/s ({rouge['pairs']} pairs x {rouge['tokens']} tokens) | {rouge['ours_pairs_per_s']:,.0f} | {ref} | {ratio} |"
    )
    if "max_abs_diff" in rouge:
        print(
            f"| max abs F1 difference on the {rouge['ref_pairs']} shared pairs | {rouge['max_abs_diff']:.2g} | | |"
        )
    if sem:
        print(
            f"| semantic completions/s ({sem['completions']} x {sem['words']} words, MiniLM-L6, CPU) | {sem['completions_per_s']:,.1f} | | |"
        )
        print(f"| semantic model load (s) | {sem['load_s']:.1f} | | |")
    print("\ncommand: python bench/graders.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
