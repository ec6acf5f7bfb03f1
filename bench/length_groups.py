"""Seconds of the training forward + backward with the completions in length groups against one group.

The training forward runs each prompt once, then the completion tokens of every row against it. With one
group every row runs as many tokens as the longest completion; with length groups (the default,
nanogrpo.model.fast.shared_prompt.length_buckets) each group of similar rows runs only its own longest. This
times both, side by side in one process, on a GRPO batch of P prompts x G completions whose lengths are given:

    python bench/length_groups.py                          # SmolLM2-135M + LoRA r=16, 4 x 8, the demo's shapes
    python bench/length_groups.py --model tiny --repeat 1  # seconds, to check that it runs
    python bench/length_groups.py --lengths 3,2,3,4 --long 64
    python bench/length_groups.py --model random:qwen2.5-1.5b --device cuda --dtype bfloat16 --long 256

--lengths is the completion lengths of one group, repeated over the batch; --long sets the last row's
completion to that many tokens (one straggler, as a sampled batch often has; 0: none). Then the same
rows, all of --lengths' longest, split into 1, 2 and 4 groups by hand: the fixed cost of one more group
(a forward and backward of the layers), which shared_prompt.group_cost weighs in token positions
(BUCKET_MIN for float32 on a CPU, BUCKET_MIN_FAST elsewhere): on a GPU this measures the value
BUCKET_MIN_FAST should have.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nanogrpo.model.fast.shared_prompt as sp  # noqa: E402
import nanogrpo.model.logprobs as lp  # noqa: E402
from nanogrpo import rollout  # noqa: E402
from nanogrpo.infra.cpu import cpu_capability  # noqa: E402
from nanogrpo.model.lora import inject_lora  # noqa: E402
from nanogrpo.model.transformer import Transformer  # noqa: E402
from nanogrpo.model.zoo import resolve_model  # noqa: E402


def make_batch(P: int, G: int, Tp: int, lens: list[int], vocab: int) -> lp.Batch:
    """P prompts of Tp tokens (the first left-padded by 3) x G completions of the given lengths."""
    g = torch.Generator().manual_seed(0)
    Tc = max(lens)
    prompt = torch.randint(10, vocab, (P, Tp), generator=g).repeat_interleave(G, 0)  # (P*G, Tp)
    pmask = torch.ones_like(prompt)
    pmask[:G, :3] = 0
    comp = torch.randint(10, vocab, (P * G, Tc), generator=g)  # (P*G, Tc)
    mask = (torch.arange(Tc)[None, :] < torch.tensor(lens)[:, None]).float()  # (P*G, Tc)
    return rollout.make_batch(prompt * pmask, pmask, comp, mask)


def fwd_bwd(head: lp.LogprobHead, batch: lp.Batch, repeat: int) -> float:
    """Best of `repeat` forward + backward passes (entropy differentiable, as with an entropy bonus), s."""
    sync = torch.cuda.synchronize if batch.ids.is_cuda else (lambda: None)
    times = []
    for _ in range(repeat + 1):  # the first is a warm-up
        sync()
        t0 = time.perf_counter()
        logp, ent = lp.completion_logprobs(head, batch, 1.0, None, entropy_grad=True)
        (logp.sum() + ent.sum()).backward()
        sync()
        times.append(time.perf_counter() - t0)
        head.zero_grad(set_to_none=True)
    return min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny, an HF folder or random:SHAPE")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=31, help="the demo's prompts are 29-34 tokens")
    ap.add_argument("--lengths", default="3,2,3,4,3,2,3,5", help="one group's completion lengths")
    ap.add_argument("--long", type=int, default=16, help="the last row's length (0: no straggler)")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    dtype = getattr(torch, a.dtype)
    model = Transformer.from_pretrained(resolve_model(a.model), dtype=dtype, device=a.device)
    inject_lora(model, r=16, alpha=32)
    model.train()
    head = sp.FastLogprobHead(model)
    V, N = model.config.vocab_size, a.prompts * a.group
    group = [int(x) for x in a.lengths.split(",")]
    lens = [group[i % len(group)] for i in range(N)]
    if a.long:
        lens[-1] = a.long
    where = f"cpu {cpu_capability()}, {torch.get_num_threads()} threads"
    if a.device != "cpu":
        where = f"{a.device} ({torch.cuda.get_device_name(a.device)})"
    print(f"model {a.model} {a.dtype} on {where}")
    print(
        f"P={a.prompts} x G={a.group}, prompts {a.prompt_tokens} tokens, completions {min(lens)}-{max(lens)}"
    )

    batch = make_batch(a.prompts, a.group, a.prompt_tokens, lens, V).to(a.device)
    one_group = (batch.mask.shape[1] - 1) * N
    groups = sp.length_buckets(
        (batch.mask.sum(1).long() - 1).clamp(min=0), sp.group_cost(model.lm_head_weight)
    )
    ran = sum(len(r) * n for r, n in groups)
    head.bucket_lengths = False
    t_one = fwd_bwd(head, batch, a.repeat)
    head.bucket_lengths = True
    t_groups = fwd_bwd(head, batch, a.repeat)
    print(f"one group:     {t_one:.3f} s  ({one_group} completion positions)")
    print(f"length groups: {t_groups:.3f} s  ({ran} positions in {len(groups)} groups: "
          f"{', '.join(f'{len(r)}x{n}' for r, n in groups)})  ratio {t_groups / t_one:.2f}")  # fmt: skip

    # the fixed cost of a group: the same rows, all of one length, split into 1, 2 and 4 groups by hand
    n = max(group) - 1
    same = make_batch(a.prompts, a.group, a.prompt_tokens, [max(group)] * N, V).to(a.device)
    base = None
    for k in (1, 2, 4):
        sp_groups = sp.length_buckets
        split = [(torch.arange(N, device=a.device)[i::k], n) for i in range(k)]
        sp.length_buckets = lambda need, min_saving, split=split: split
        try:
            t = fwd_bwd(head, same, a.repeat)
        finally:
            sp.length_buckets = sp_groups
        base = base or t
        print(
            f"all {max(group)} tokens, {k} group(s): {t:.3f} s  (+{(t - base) / max(k - 1, 1):.3f} s a group)"
        )
    print("reproduce: python bench/length_groups.py " + shlex.join(sys.argv[1:]))


if __name__ == "__main__":
    main()
