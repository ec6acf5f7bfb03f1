"""Which code a run takes: the reading path (--plain: docs/reading-path.txt, as it reads) or the fast paths
beside it (the default), which compute the same to rounding (tests/test_plain.py).

    set_plain(cfg.plain)      # once, at start-up (train.py, eval.py generate)
    if plain(): ...           # where a call picks its path: the rollout, policy.logprob_head, the attention
                              # call, an episode's sampler, fast.sampler.generate

Under --plain the sampler runs the plain loop (sampling.generate; an episode, sampling.Episodes, the same
loop's cache continued) on the weights as they are (LoRA as its own forward computes it: nothing packed or
folded), the policy's log-probs are LogprobHead's one forward and plain_token_logprobs (no shared-prompt
prefix, no chunked or Triton head), and attention is SDPA as it is (no kernel of attention.py). So an edit on
the reading path (a LoRA variant, the model's forward) samples and trains as written. The default takes the
fast paths (model/fast/): packed weights with LoRA folded, the grouped cache, the row sampler, the
shared-prompt log-prob head with nanogrpo_kernels' LM head, and the attention kernels.
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
