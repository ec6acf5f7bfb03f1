"""The research preset's own data, made from the search task's rows (search.jsonl) and the shipped corpus.

A small model does not call a tool on its own (SmolLM2-135M-Instruct wrote no search in 96 sampled first
turns), so the research preset first fine-tunes on transcripts of the search episode done right, then runs
GRPO on the episodes themselves. Both files below are made from the training rows only; the held-out rows
(search.eval.jsonl) stay unseen by the SFT stage and by the probe judge.

- research.jsonl: a transcript a training row, in the conversational prompt-completion form SFT reads
  (`completion`: assistant turns and the tool's messages): the question searched as asked, the tool's
  passages exactly as the `search` environment returns them, then `<answer>ANSWER [ID]</answer>`.
- research.labels.jsonl: the probe judge's training labels, {"prompt", "response", "criterion", "label"}:
  seven episodes a training row (right or wrong answer, with or without the right citation, no search, no
  answer), each as the judges read an episode (rewards.base.transcript), labelled by rule for the row's two
  rubric criteria. The rules are what the criteria say, so the labels are exact.

    python -m nanogrpo.recipes.research      # writes both files again (tests check they are up to date)
"""

from __future__ import annotations

import json
import sys

from nanogrpo.envs.builtin import Search, corpus
from nanogrpo.recipes import HERE
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


def episodes(row: dict, wrong: str, other_id: str) -> list[tuple[list[dict], bool, bool]]:
    """Seven episodes of a row as (turns after the prompt, states the answer, cites its source): `wrong` is
    another row's answer, `other_id` a passage that is not the row's source."""
    search_turns = transcript(row)[:2]
    ans, src = row["answer"], row["sources"][0]

    def answer(text: str) -> dict:
        return {"role": "assistant", "content": f"<answer>{text}</answer>"}

    return [
        (search_turns + [answer(f"{ans} [{src}]")], True, True),
        (search_turns + [answer(ans)], True, False),
        (search_turns + [answer(f"{ans} [{other_id}]")], True, False),
        (search_turns + [answer(f"{wrong} [{src}]")], False, True),
        (search_turns + [answer(wrong)], False, False),
        ([answer(ans)], True, False),  # answered without searching: nothing to cite
        (search_turns, False, False),  # searched, never answered (the turn budget ran out)
    ]


def labels(rows: list[dict]) -> list[dict]:
    """The probe's labels: each row's seven episodes x its rubric's two criteria (the answer, the citation)."""
    ids = [p["id"] for p in corpus()]
    out = []
    for k, row in enumerate(rows):
        wrong = rows[(k + 1) % len(rows)]["answer"]
        other = next(i for i in ids[k % len(ids) :] + ids if i not in row["sources"])
        states, cites = (c["criterion"] for c in row["rubric"])
        for turns, right, cited in episodes(row, str(wrong), other):
            response = turn_text(turns)  # as the judges read an episode (rewards.base.transcript)
            for criterion, label in ((states, right), (cites, cited)):
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


def main() -> int:
    for name, text in made().items():
        (HERE / name).write_text(text, encoding="utf-8")
        print(f"{HERE / name}: {text.count(chr(10))} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
