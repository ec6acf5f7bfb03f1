"""The research preset's own data, made from the search task's rows (search.jsonl) and the shipped corpus.

A small model does not call a tool on its own (SmolLM2-135M-Instruct wrote no search in 96 sampled first
turns), so the research preset first fine-tunes on transcripts of the search episode done right, then runs
GRPO on the episodes themselves. Both files below are made from the training rows only; the held-out rows
(search.eval.jsonl) stay unseen by the SFT stage and by the probe judge.

- research.jsonl: a transcript a training row, in the conversational prompt-completion form SFT reads
  (`completion`: assistant turns and the tool's messages): the question searched as asked, the tool's
  passages exactly as the `search` environment returns them, then `<answer>ANSWER [ID]</answer>`.
- research.labels.jsonl: the probe judge's training labels, {"prompt", "response", "criterion", "label"}:
  eighteen episodes a training row, right and wrong in the ways a small model's are (the right or another
  row's answer, with the right, another, several or no citations; the question echoed; the passage copied;
  no search; no answer; a call that never closes), each as the judges read an episode (rewards.base.transcript), and
  labelled for the row's two rubric criteria by the search environment's own rule (`solved`, `cited`).

    python -m nanogrpo.lab.research files   # writes both files again (tests check they are up to date)

The pipeline, each stage one documented command, run in order by `python -m nanogrpo.lab.research run`
(a stage whose output is already there is skipped, so a run cut short goes on where it stopped; flags after
`run` go to both train.py stages, e.g. --model.threads 2):

    python -m nanogrpo.eval.probe train --data nanogrpo/recipes/research.labels.jsonl --model smollm2 \
        --out runs/research/probe
    python train.py research-sft     # SFT on the transcripts -> runs/research/sft/adapter
    python train.py research         # GRPO from that adapter -> runs/research/grpo

and then one table: each held-out metric before SFT, after SFT and after GRPO, from the two runs' eval.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from nanogrpo.envs.builtin import Search, corpus
from nanogrpo.recipes import HERE
from nanogrpo.recipes.presets import PRESETS, RESEARCH_PROBE_ARGS
from nanogrpo_base.rows import turn_text

SFT_FILE, LABELS_FILE = "research.jsonl", "research.labels.jsonl"


def question(row: dict) -> str:
    """The question a row asks, without the instructions after it: what the transcripts search for."""
    return row["prompt"].split("?")[0].strip() + "?"


def observation(row: dict, turn: str) -> str:
    """What the search environment answers to the assistant turn `turn` of an episode of `row`."""
    env = Search()
    env.reset(row, 0)
    return env.step(turn).observation


def transcript(row: dict) -> list[dict]:
    """The search episode done right: search the question, answer citing the source passage."""
    first = f"<search>{question(row)}</search>"
    return [
        {"role": "assistant", "content": first},
        {"role": "tool", "content": observation(row, first)},
        {"role": "assistant", "content": f"<answer>{row['answer']} [{row['sources'][0]}]</answer>"},
    ]


def episodes(row: dict, wrong: str, other_id: str) -> list[list[dict]]:
    """Eighteen episodes of a row (turns after the prompt), right and wrong in the ways a small model's are:
    `wrong` is another row's answer, `other_id` a passage that is not the row's source."""
    searched = transcript(row)[:2]
    ans, src, q = row["answer"], row["sources"][0], question(row)
    passage = next(p["text"] for p in corpus() if p["id"] == src)

    def answer(text: str) -> dict:
        return {"role": "assistant", "content": f"<answer>{text}</answer>"}

    finals = [
        f"{ans} [{src}]", ans, f"{ans} [{other_id}]", f"{wrong} [{src}]", wrong, f"{wrong} [{other_id}]",
        q, f"{q} [{src}]",  # the question echoed as the answer
        passage, f"{passage} [{src}]",  # the passage copied whole
        f"{ans} [{src}] [{other_id}]", f"{wrong} [{src}] [{other_id}]",  # more than one citation
        f"{ans} [{src}] [{src}] [{src}]", f"{wrong} [{src}] [{src}] [{src}]", f"{wrong} [{other_id}] [{other_id}]",
    ]  # fmt: skip
    return [
        *(searched + [answer(text)] for text in finals),
        [answer(f"{ans} [{src}]")],  # answered without searching: the id is not a passage it read
        searched,  # searched, never answered (the turn budget ran out)
        [{"role": "assistant", "content": "<search>" * 12}],  # a loop that never closes its call
    ]


def verdicts(row: dict, turns: list[dict]) -> tuple[bool, bool]:
    """(states the answer, cites its source) of an episode, as the search environment rules its last step
    (envs/builtin.py: `solved`, `cited`): the labels follow the environment's own checks."""
    env, info = Search(), {}
    env.reset(row, 0)
    for t in turns:
        if t["role"] == "assistant":
            info = env.step(t["content"]).info
    return bool(info.get("solved")), bool(info.get("cited"))


def labels(rows: list[dict]) -> list[dict]:
    """The probe's labels: each row's eighteen episodes x its rubric's two criteria (the answer, the
    citation), each labelled by the environment's rule."""
    ids = [p["id"] for p in corpus()]
    out = []
    for k, row in enumerate(rows):
        wrong = rows[(k + 1) % len(rows)]["answer"]
        other = next(i for i in ids[k % len(ids) :] + ids if i not in row["sources"])
        states, cites = (c["criterion"] for c in row["rubric"])
        for turns in episodes(row, str(wrong), other):
            response = turn_text(turns)  # as the judges read an episode (rewards.base.transcript)
            for criterion, label in zip((states, cites), verdicts(row, turns)):
                out.append(
                    {
                        "prompt": row["prompt"],
                        "response": response,
                        "criterion": criterion,
                        "label": int(label),
                    }
                )
    return out


def made() -> dict[str, str]:
    """Each file's name and the text it should hold, from the search task's training rows."""
    rows = [json.loads(line) for line in (HERE / "search.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        assert [c["criterion"] for c in row["rubric"]][1].startswith("Cites"), row["id"]
    sft = [{**r, "completion": transcript(r)} for r in rows]  # the row as it is, its transcript added
    dump = lambda rs: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rs)  # noqa: E731
    return {SFT_FILE: dump(sft), LABELS_FILE: dump(labels(rows))}


def write_files() -> int:
    for name, text in made().items():
        (HERE / name).write_text(text, encoding="utf-8")
        print(f"{HERE / name}: {text.count(chr(10))} rows")
    return 0


# where each stage writes: the presets' folders and the GRPO preset's probe
PROBE = Path(PRESETS["research"][1].reward.rubric.probe)
SFT, GRPO = Path(PRESETS["research-sft"][1].out_dir), Path(PRESETS["research"][1].out_dir)
TRAIN = str(Path(__file__).resolve().parents[2] / "train.py")  # the checkout's train.py, from any folder


def stages(flags: list[str]) -> list[tuple[str, Path, list[str]]]:
    """(name, the file that says it is done, its command) of each stage, in order."""
    py = sys.executable
    return [
        ("probe judge", PROBE / "probe.json", [py, *RESEARCH_PROBE_ARGS]),
        ("SFT", SFT / "eval.json", [py, TRAIN, "research-sft", *flags]),
        ("GRPO", GRPO / "eval.json", [py, TRAIN, "research", *flags]),
    ]


def table(sft: dict, grpo: dict) -> str:
    """Each held-out metric before SFT, after SFT and after GRPO, with GRPO's gain over SFT and its 95% CI."""
    held = f"held-out ({grpo['n']} rows)"
    lines = [f"{held:20s} {'base':>6s} {'SFT':>6s} {'GRPO':>6s}   GRPO - SFT [95% CI]"]
    for m, g in grpo["metrics"].items():
        s = sft["metrics"].get(m, {})
        base = f"{s['mean_a']:6.3f}" if s else f"{'':6s}"
        lines.append(
            f"{m:20s} {base} {g['mean_a']:6.3f} {g['mean_b']:6.3f}   {g['diff']:+.3f} [{g['low']:+.3f}, {g['high']:+.3f}]"
        )
    if "answers" in sft and "answers" in grpo:  # the distinct answers each model gives (eval/evaluate.py)
        from nanogrpo.eval.evaluate import format_answers

        sides = {
            "base": sft["answers"]["base"],
            "SFT": sft["answers"]["trained"],
            "GRPO": grpo["answers"]["trained"],
        }
        lines.append(format_answers(sides))
    return "\n".join(lines)


def judge_check(path: Path) -> tuple[float, float, int]:
    """How often the judge's verdicts on the held-out episodes of an eval file (eval_base.jsonl,
    eval_trained.jsonl) agree with the search environment's own checks of the same two criteria (its info's
    `solved` and `cited`; no answer: neither): (answer, citation, episodes). The verdicts are read back from
    each episode's rubric score, which with the two criteria's different weights names exactly one pair."""
    from rewards.rubric import parse_rubric, rubric_score

    agree, n = [0, 0], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        score, weights = (rec.get("scores") or {}).get("rubric"), [w for _, w in parse_rubric(rec["rubric"])]
        if score is None or rec.get("turns") is None:
            continue
        pairs = [(a, c) for a in (0.0, 1.0) for c in (0.0, 1.0)]
        a, c = min(pairs, key=lambda v: abs(rubric_score(list(v), weights) - score))  # the judge's verdicts
        info = rec.get("env_info") or {}
        agree[0] += bool(a) == bool(info.get("solved"))
        agree[1] += bool(c) == bool(info.get("cited"))
        n += 1
    return agree[0] / max(n, 1), agree[1] / max(n, 1), n


def check_flags(flags: list[str]) -> int:
    """0 when train.py takes `flags` over both its stages' presets (parsed and checked as its start-up does,
    before any model loads); else tyro's message or one `error:` line is printed, and the exit code."""
    import tyro

    from nanogrpo.config import TrainConfig
    from nanogrpo.infra.flag_checks import check_config

    for preset in ("research-sft", "research"):
        try:
            check_config(
                tyro.cli(TrainConfig, default=PRESETS[preset][1], args=flags, prog=f"train.py {preset}")
            )
        except SystemExit as e:  # tyro said what is wrong (or printed --help)
            return e.code if isinstance(e.code, int) else 2
        except ValueError as e:
            print(f"error: train.py {preset}: {e}", file=sys.stderr)
            return 2
    return 0


def run(flags: list[str]) -> int:
    """The three stages in order, each printed before it runs and skipped when its output is there; the flags
    for train.py's stages are checked first, so that a typo is said before the first stage runs."""
    if code := check_flags(flags):
        print("research: the flags after `run` go to train.py's two stages; nothing has run", file=sys.stderr)
        return code
    t0 = time.perf_counter()
    for name, done, cmd in stages(flags):
        shown = " ".join(["python", *cmd[1:]]).replace(TRAIN, "train.py")
        if done.is_file():
            print(f"research: {name} done ({done} exists), skipped: {shown}", flush=True)
            continue
        print(f"research: {name}: {shown}", flush=True)
        t1 = time.perf_counter()
        rc = subprocess.call(cmd)
        if rc != 0:
            print(f"research: {name} failed (exit {rc}); fix it and run again: done stages are skipped")
            return rc
        print(f"research: {name} took {time.perf_counter() - t1:.0f} s", flush=True)
    read = lambda path: json.loads(path.read_text(encoding="utf-8"))  # noqa: E731
    print(table(read(SFT / "eval.json"), read(GRPO / "eval.json")))
    # the judge checked against the environment's rule on the same episodes: a policy can learn what a small
    # judge rewards rather than the task (Small-LM Judges saw larger probes saturate on the actor's rollouts)
    for name, path in (("SFT", SFT / "eval_trained.jsonl"), ("GRPO", GRPO / "eval_trained.jsonl")):
        a, c, n = judge_check(path)
        print(
            f"judge check, {name}'s {n} held-out episodes: the probe's verdicts agree with the environment's own "
            f"checks on {a:.0%} (answer) and {c:.0%} (citation)"
        )
    print(f"research: the pipeline took {time.perf_counter() - t0:.0f} s (stages skipped not counted)")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["files"]:
        return write_files()
    if argv[:1] == ["run"]:
        return run(argv[1:])
    print("usage: python -m nanogrpo.lab.research files | run [train.py flags]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
