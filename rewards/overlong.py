"""overlong: DAPO's soft overlong punishment, a length penalty in [-1, 0] (Yu et al. 2025).

With L the most tokens a completion may have (--reward.overlong-max-tokens, by default the sampler's
--sampling.max-new-tokens) and B the buffer before it (--reward.overlong-buffer, by default L // 4), a
completion of n tokens scores

     0                   when n <= L - B
     (L - B - n) / B     when L - B < n <= L   (linearly from 0 down to -1)
    -1                   when n > L

Add it to the task's reward, e.g. --reward.spec 'rouge_l:1,overlong:1': the sum is the task score minus
the penalty. It is the one grader whose score is not in [0, 1]: it lives in [-1, 0].

It reads the completion's token count, `Sample.tokens`, which the trainer sets; where it is None (a
caller that does not count tokens, `eval.py grade` on a file) the grader returns None: it does not apply.
DAPO's default is L = 20480 with B = 4096 (a fifth); a quarter is the default here because nanogrpo's
limits are short and a wider ramp gives a smoother signal.
"""

from __future__ import annotations

from rewards.base import Grader, Sample
from rewards.options import RewardConfig
from rewards.registry import register


def overlong_limits(cfg: RewardConfig) -> tuple[int, int]:
    """(L, B) from the options: B defaults to L // 4. L = 0 (not filled in yet) gives (0, 0); a setting
    that cannot work raises ValueError with the fix."""
    L, B = cfg.overlong_max_tokens, cfg.overlong_buffer
    if L < 0 or B < 0:
        raise ValueError(
            f"--reward.overlong-max-tokens ({L}) and --reward.overlong-buffer ({B}) must be >= 0 (0 = auto)"
        )
    if L == 0:
        return 0, 0
    B = B or L // 4
    if not 0 < B < L:
        raise ValueError(
            f"--reward.overlong-buffer {B} must be between 1 and the limit {L} - 1 (the penalty starts at "
            f"L - B tokens); pass a smaller --reward.overlong-buffer or a larger --reward.overlong-max-tokens"
        )
    return L, B


def overlong_penalty(n: int, L: int, B: int) -> float:
    """The penalty of an n-token completion: 0 up to L - B tokens, then linearly down to -1 at L."""
    if n <= L - B:
        return 0.0
    return max(-1.0, (L - B - n) / B)


class Overlong(Grader):
    requires = ()

    def __init__(self, cfg: RewardConfig):
        self.L, self.B = overlong_limits(cfg)

    def __call__(self, batch: list[Sample]) -> list[float | None]:
        # the base class clips to [0, 1]; this grader's scores live in [-1, 0]
        return self.score(batch)

    def score(self, batch: list[Sample]) -> list[float | None]:
        if self.L == 0 and any(s.tokens is not None for s in batch):
            raise ValueError(
                "overlong: the samples carry token counts but the limit is unknown; build the reward from "
                "rewards.options.with_max_tokens(cfg, max_new_tokens) or set --reward.overlong-max-tokens"
            )
        return [None if s.tokens is None else overlong_penalty(s.tokens, self.L, self.B) for s in batch]


@register("overlong")
def _overlong(cfg: RewardConfig) -> Grader:
    return Overlong(cfg)
