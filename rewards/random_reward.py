"""random: a reward that carries no signal, the control run of a reward study (RLVRR's random-reward
baseline). If training on it "improves" a metric, that gain is not the reward's doing.

Each completion scores a uniform number in [0, 1) drawn from a hash of (--reward.random-seed, its prompt,
its text, its place among its group's completions). So the scores do not depend on the batch, the rank or
the run's history: a resumed or torchrun run gets the same numbers, and two equal completions of one
group still score differently. Departure from a fresh draw per call: the same text at the same place of
the same prompt's group scores the same at every step, a fixed random function of the text rather than
new noise each time (which could not be reproduced across ranks or a resume without more state).
"""

from __future__ import annotations

import hashlib

from rewards.base import Grader, Sample
from rewards.options import RewardConfig
from rewards.registry import register


def random_score(seed: int, prompt: str, completion: str, place: int) -> float:
    """Uniform in [0, 1): 53 bits of blake2b over the seed, the prompt, the text and its place."""
    key = f"{seed}\x00{place}\x00{prompt}\x00{completion}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / float(1 << 53)


class RandomReward(Grader):
    requires = ()

    def __init__(self, cfg: RewardConfig):
        self.seed = cfg.random_seed

    def score(self, batch: list[Sample]) -> list[float | None]:
        seen: dict[int, int] = {}  # group -> completions of it met so far (the place of the next one)
        out = []
        for s in batch:
            place = seen.get(s.group, 0)
            seen[s.group] = place + 1
            out.append(random_score(self.seed, s.prompt, s.completion, place))
        return out


@register("random")
def _random(cfg: RewardConfig) -> Grader:
    return RandomReward(cfg)
