"""The built-in demo task: one-word answers to short questions (capitals, opposites, colours, plurals,
animal sounds, sums), split 75/25 per question type, and the `demo` preset that trains on it
(`python train.py`, `python train.py demo`)."""

from __future__ import annotations

import random

from nanogrpo.config import (
    GRPOConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    SamplingConfig,
    TrainConfig,
)

_FACTS: dict[str, list[tuple[str, str]]] = {
    "What is the capital of {}?": [
        ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
        ("Japan", "Tokyo"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Greece", "Athens"),
        ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Austria", "Vienna"),
        ("Poland", "Warsaw"), ("China", "Beijing"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
        ("Cuba", "Havana"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Belgium", "Brussels"),
        ("Hungary", "Budapest"), ("Thailand", "Bangkok"), ("England", "London"), ("Denmark", "Copenhagen"),
        ("Canada", "Ottawa"), ("Argentina", "Buenos Aires"), ("Turkey", "Ankara"), ("India", "Delhi"),
    ],
    "What is the opposite of {}?": [
        ("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("day", "night"),
        ("open", "closed"), ("happy", "sad"), ("light", "dark"), ("old", "young"), ("rich", "poor"),
        ("early", "late"), ("hard", "soft"), ("full", "empty"), ("wet", "dry"), ("love", "hate"),
        ("win", "lose"), ("left", "right"), ("black", "white"), ("top", "bottom"), ("thick", "thin"),
        ("strong", "weak"), ("loud", "quiet"), ("push", "pull"), ("true", "false"),
    ],
    "What color is {}?": [
        ("the sky on a clear day", "blue"), ("fresh grass", "green"), ("snow", "white"),
        ("a ripe banana", "yellow"), ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange"),
        ("milk", "white"), ("a lemon", "yellow"), ("blood", "red"), ("a crow", "black"),
        ("a strawberry", "red"), ("a frog", "green"), ("the sea", "blue"), ("chocolate", "brown"),
        ("a polar bear", "white"),
    ],
    "What is the plural of {}?": [
        ("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"), ("man", "men"),
        ("woman", "women"), ("goose", "geese"), ("person", "people"), ("cat", "cats"), ("box", "boxes"),
        ("leaf", "leaves"), ("knife", "knives"), ("city", "cities"), ("baby", "babies"), ("ox", "oxen"),
        ("wolf", "wolves"),
    ],
    "Which animal says {}?": [
        ("moo", "cow"), ("woof", "dog"), ("meow", "cat"), ("oink", "pig"), ("baa", "sheep"),
        ("quack", "duck"), ("neigh", "horse"), ("hoot", "owl"), ("ribbit", "frog"), ("hiss", "snake"),
        ("roar", "lion"), ("buzz", "bee"),
    ],
    "What is {}?": [
        ("two plus two", "four"), ("three plus four", "seven"), ("five plus five", "ten"),
        ("six minus two", "four"), ("nine minus three", "six"), ("two times three", "six"),
        ("one plus one", "two"), ("eight minus one", "seven"), ("four plus five", "nine"),
        ("ten minus two", "eight"), ("three times three", "nine"), ("seven minus seven", "zero"),
    ],
}  # fmt: skip

DEMO_INSTRUCTION = "Reply with just the answer, one word."


def demo_rows(split: str = "train", seed: int = 1234, system: bool = True) -> list[dict]:
    """The built-in task: every fact once, split 75/25 per question type (deterministic).

    system: the instruction is the system message (the demo preset's: 31 tokens a prompt with SmolLM2's chat
    template), or, False, it follows the question in one user message (the KL study's LM grid and
    bench/step.py)."""
    if split not in ("train", "eval"):
        raise ValueError(f"demo split must be 'train' or 'eval', got {split!r}")
    rows = []
    rng = random.Random(seed)
    for template, facts in _FACTS.items():
        facts = list(facts)
        rng.shuffle(facts)
        n_eval = len(facts) // 4
        chosen = facts[:n_eval] if split == "eval" else facts[n_eval:]
        for subject, answer in chosen:
            question = template.format(subject)
            if system:
                prompt = [
                    {"role": "system", "content": DEMO_INSTRUCTION},
                    {"role": "user", "content": question},
                ]
            else:
                prompt = [{"role": "user", "content": f"{question} {DEMO_INSTRUCTION}"}]
            rows.append(
                {"id": f"demo-{split}-{len(rows)}", "prompt": prompt, "reference": answer, "answer": answer}
            )
    return rows


def demo_text_rows(split: str = "train") -> list[dict]:
    """The task as plain text, for a base model without a chat template ('demo-text', the gemma3 preset): the
    question, the instruction and a newline; the answer is the line that follows."""
    return [{**r, "prompt": f"{r['prompt'][1]['content']} {DEMO_INSTRUCTION}\n"} for r in demo_rows(split)]


# the demo preset (recipes/presets.py lists it): SmolLM2-135M-Instruct + LoRA on demo_rows
DEMO = TrainConfig(
    steps=60,
    prompts_per_step=4,
    eval_prompts=27,
    out_dir="runs/demo",
    model=ModelConfig(path="smollm2"),
    lora=LoraConfig(r=16, alpha=32),
    # T=1 and clip-higher (DAPO) keep the groups varied long enough to find the one-word answer;
    # so do no std division (a group of near-identical sentences gets near-zero advantages, not
    # unit ones) and a small entropy bonus. The length penalty (DAPO's overlong grader: 0 up to 4
    # tokens, -1 at 16) pays a sentence for every word it drops, a path down to the one-word answer
    # that does not wait for that answer to be sampled: without it the policy could settle on "The
    # capital of Cuba is Havana." (docs/STABILITY.md, "The demo on every CPU")
    sampling=SamplingConfig(max_new_tokens=16, temperature=1.0),
    grpo=GRPOConfig(group_size=8, eps_high=0.28, scale_rewards="none", entropy_coef=0.005),
    optim=OptimConfig(lr=3e-4),
    reward=RewardConfig(spec="rouge_l:1,overlong:1", overlong_buffer=12),
)
