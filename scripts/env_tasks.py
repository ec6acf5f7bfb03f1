"""Writes the built-in environments' task files (nanogrpo/recipes/{calc,guess,search}[.eval].jsonl and
search_corpus.jsonl), deterministically: `python scripts/env_tasks.py`. The files are committed; this is
how they were made."""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "nanogrpo" / "recipes"

CALC_PROMPT = (
    "What is {expr}? You have a calculator: write <calc>expression</calc> and it replies with the value. "
    "Then give the final answer as <answer>number</answer>."
)

# (id, passage, question, answer)
FACTS = [
    ("nile", "The Nile is about 6650 km long and flows north into the Mediterranean Sea.", "How long is the Nile in km?", "6650"),
    ("everest", "Mount Everest is 8849 metres high, on the border of Nepal and China.", "How high is Mount Everest in metres?", "8849"),
    ("moon", "The Moon is on average 384400 km from the Earth.", "How far is the Moon from the Earth in km?", "384400"),
    ("water", "Pure water boils at 100 degrees Celsius at sea level.", "At how many degrees Celsius does water boil at sea level?", "100"),
    ("spider", "A spider has eight legs; an insect has six.", "How many legs does a spider have?", "eight"),
    ("hexagon", "A hexagon is a polygon with six sides.", "How many sides does a hexagon have?", "six"),
    ("mars", "Mars is called the red planet because of iron oxide on its surface.", "Which planet is called the red planet?", "Mars"),
    ("paris", "Paris is the capital of France and lies on the river Seine.", "Which river runs through the capital of France?", "Seine"),
    ("rome", "Rome, the capital of Italy, lies on the river Tiber.", "Which river runs through Rome?", "Tiber"),
    ("tokyo", "Tokyo is the capital of Japan, on the island of Honshu.", "On which island is Tokyo?", "Honshu"),
    ("oxygen", "Oxygen has the atomic number 8 and the symbol O.", "What is the atomic number of oxygen?", "8"),
    ("gold", "The chemical symbol of gold is Au, from the Latin aurum.", "What is the chemical symbol of gold?", "Au"),
    ("heart", "The human heart has four chambers: two atria and two ventricles.", "How many chambers does the human heart have?", "four"),
    ("light", "Light travels at about 299792 km per second in a vacuum.", "How fast does light travel in km per second?", "299792"),
    ("piano", "A standard piano has 88 keys, 52 white and 36 black.", "How many keys does a standard piano have?", "88"),
    ("olympics", "The modern Olympic Games were first held in Athens in 1896.", "In which year were the first modern Olympic Games held?", "1896"),
    ("bees", "Honey bees live in colonies led by a single queen.", "Who leads a colony of honey bees?", "queen"),
    ("sahara", "The Sahara is the largest hot desert, covering much of North Africa.", "Which is the largest hot desert?", "Sahara"),
    ("amazon", "The Amazon river carries more water than any other river on Earth.", "Which river carries the most water?", "Amazon"),
    ("penguin", "Emperor penguins live in Antarctica and are the tallest penguins.", "Where do emperor penguins live?", "Antarctica"),
    ("bone", "The femur, in the thigh, is the longest bone of the human body.", "What is the longest bone of the human body?", "femur"),
    ("chess", "A chess board has 64 squares in eight rows of eight.", "How many squares does a chess board have?", "64"),
    ("venus", "Venus is the hottest planet of the solar system, hotter than Mercury.", "Which is the hottest planet of the solar system?", "Venus"),
    ("violin", "A violin usually has four strings tuned in fifths.", "How many strings does a violin usually have?", "four"),
]  # fmt: skip

# distractors: passages that share words with the questions but answer none of them
OTHER = [
    ("danube", "The Danube flows east through ten countries into the Black Sea."),
    ("jupiter", "Jupiter is the largest planet of the solar system."),
    ("iron", "Iron has the symbol Fe and rusts in water and air."),
    ("guitar", "A classical guitar has six strings."),
]


def main() -> None:
    rng = random.Random(2026)
    rows = []
    for i in range(240):
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        op = rng.choice(["*", "*", "+", "-"])
        c = rng.randint(2, 9)
        expr = f"{a} {op} {b} + {c}" if op != "*" else f"{a} * {b}"
        rows.append(
            {"id": f"calc-{i:03d}", "prompt": CALC_PROMPT.format(expr=expr), "answer": str(eval(expr))}
        )
    write("calc", rows[:192], rows[192:])
    guess = [{"id": f"guess-{i:03d}", "prompt": "Guess the number.", "lo": 1, "hi": hi}
             for i, hi in enumerate([8, 10, 12, 16, 20] * 12)]  # fmt: skip
    write("guess", guess[:45], guess[45:])
    corpus = [{"id": k, "text": t} for k, t, _, _ in FACTS] + [{"id": k, "text": t} for k, t in OTHER]
    (OUT / "search_corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in corpus))
    search = []
    for k, text, q, ans in FACTS:
        prompt = (f"{q} Search first: write <search>words</search> to get passages, each with its [id]. Then "
                  "answer as <answer>your answer [id]</answer>, citing the passage you used.")  # fmt: skip
        rubric = [{"criterion": f"States that the answer is {ans}", "weight": 2},
                  {"criterion": "Cites the passage it used by its id in square brackets", "weight": 1}]  # fmt: skip
        search.append({"id": f"search-{k}", "prompt": prompt, "answer": ans, "sources": [k], "reference": text,
                       "rubric": rubric})  # fmt: skip
    rng.shuffle(search)
    write("search", search[:18], search[18:])


def write(name: str, train: list[dict], held_out: list[dict]) -> None:
    for suffix, rows in (("", train), (".eval", held_out)):
        (OUT / f"{name}{suffix}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
