"""The fast paths: each computes what a plain function on the reading path computes (to float32 rounding,
tested equal), faster; a --plain run takes none of them (model/paths.py).

- sampler.py: the default sampler's entry (`generate`) and the weights it samples with;
- grouped.py: a prompt's keys once for its G samples, ended rows dropped (--sampling.decode eager);
- row_sampler.py: a cache row a sample, continued from turn to turn (episodes), and the decode step (its
  state in fixed-shape tensors, DecodeState) that static_decode.py compiles or replays as a CUDA graph
  (--sampling.decode static|compiled|graph);
- packed.py: the CPU's packed sampling weights, LoRA folded in;
- shared_prompt.py: the log-prob forward with each prompt run once for its group (FastLogprobHead);
- kvcache.py: the fixed-shape key buckets and the training forward's prompt prefix.

They import the plain modules (sampling.py, logprobs.py, transformer.py), never the reverse.
"""

from nanogrpo.model.fast import sampler  # noqa: F401  (rollout.py: fast.sampler.generate)
