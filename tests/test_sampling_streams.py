"""One random stream per prompt: a prompt's samples do not depend on the batch it is in."""

import pytest
import torch

from nanogrpo.model.fast.sampler import generate
from nanogrpo.model.transformer import Transformer


@pytest.mark.parametrize("decode", ["eager", "static", "graph"])
def test_per_prompt_generators_make_samples_batch_independent(tiny_model_dir, decode):
    """Each decode loop (what lets torchrun ranks reproduce a one-process run); 'graph' off CUDA runs the loop a
    graph records, and 'compiled' runs the static loop's step (tests/test_sampling_compiled.py)."""
    model = Transformer.from_pretrained(tiny_model_dir)
    a, b = [5, 17, 33, 2, 9], [40, 41]
    gen = lambda seed: torch.Generator().manual_seed(seed)
    kw = dict(group_size=3, max_new_tokens=12, temperature=1.0, top_k=20, eos_ids=(7,), decode=decode)
    both = generate(model, [a, b], generator=[gen(1), gen(2)], **kw)
    alone_b = generate(model, [b], generator=[gen(2)], **kw)
    alone_a = generate(model, [a], generator=[gen(1)], **kw)
    for rows, alone in ((slice(0, 3), alone_a), (slice(3, 6), alone_b)):
        T = alone.completion_ids.shape[1]
        assert torch.equal(both.completion_ids[rows, :T], alone.completion_ids)
        assert torch.allclose(both.logp[rows, :T], alone.logp, atol=1e-5)
    other = generate(model, [a], generator=[gen(3)], **kw)
    assert not torch.equal(other.completion_ids, alone_a.completion_ids)  # the stream matters
