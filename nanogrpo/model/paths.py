"""Which code a run takes: the reading path (--plain: docs/reading-path.txt, as it reads) or the fast paths
beside it (the default), which compute the same to rounding (tests/test_plain.py).

    set_plain(cfg.plain)      # once, at start-up (train.py, eval.py generate)
    if plain(): ...           # every fast path asks before it takes a call

Under --plain the sampler runs the plain loop (sampling.plain_generate; an episode, the row sampler's loop)
on the weights as they are (LoRA as its own forward computes it: nothing packed or folded), the policy's
log-probs are plain_token_logprobs over one forward (no shared-prompt prefix, no chunked or Triton head), and
attention is SDPA as it is (no kernel of attention.py). So an edit on the reading path (a LoRA variant, the
model's forward) samples and trains as written. The default takes the fast paths: packed weights with LoRA
folded (packed.py), the grouped cache (grouped.py), the shared-prompt log-prob head (shared_prompt.py,
nanogrpo_kernels), the attention kernels.
"""

from __future__ import annotations

_PLAIN = False


def plain() -> bool:
    """Whether this run takes the reading path only (--plain)."""
    return _PLAIN


def set_plain(on: bool) -> None:
    """Decide it, for the process (each run's start-up sets it, so no run inherits another's)."""
    global _PLAIN
    _PLAIN = bool(on)
