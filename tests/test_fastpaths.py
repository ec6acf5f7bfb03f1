"""The speed-ups must not change results: shared-prompt training forward, packed CPU sampling weights, the
float32 sampling cache and the single-query decode attention, each against the plain path."""

import pytest
import torch
import torch.nn.functional as F
from helpers import packing_params, use_packer

from nanogrpo.model import lora
from nanogrpo.model.attention import decode_attention
from nanogrpo.model.fast.kvcache import PrefixKV
from nanogrpo.model.fast.packed import REPACK_MIN_STEPS, Packed, packed_weights, packing_supported
from nanogrpo.model.fast.sampler import generate
from nanogrpo.model.fast.shared_prompt import (
    BUCKET_MIN,
    BUCKET_MIN_FAST,
    BUCKET_SHARE,
    FastLogprobHead,
    length_buckets,
)
from nanogrpo.model.logprobs import LogprobHead, completion_logprobs
from nanogrpo.model.sampling import pad_left
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import resolve_model
from nanogrpo.rollout import make_batch

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
G = 3


@pytest.fixture(scope="module")
def tiny_dir():
    return resolve_model("tiny")


def lora_model(tiny_dir, dtype=torch.float32, seed=0) -> Transformer:
    """The tiny model with LoRA whose B is non-zero, so the adapters change the output."""
    torch.manual_seed(seed)
    m = Transformer.from_pretrained(tiny_dir, dtype=dtype)
    lora.inject_lora(m, r=4, alpha=8)
    for mod in lora.lora_modules(m).values():
        torch.nn.init.normal_(mod.lora_B.weight, std=0.05)
    return m


def group_batch(vocab: int, seed: int = 0):
    """P=3 prompts of different lengths (left padding) x G=3 completions of mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    p_ids, p_mask = pad_left(PROMPTS, 0)
    p_ids, p_mask = p_ids.repeat_interleave(G, 0), p_mask.repeat_interleave(G, 0)  # (9, Tp)
    comp = torch.randint(1, vocab, (len(p_ids), 6), generator=g)  # (9, 6)
    mask = torch.ones(len(p_ids), 6)
    mask[1, 3:], mask[4, 1:], mask[8, 5:] = 0, 0, 0
    return make_batch(p_ids, p_mask, comp, mask)


def logp_and_grads(model, batch):
    logp, ent = completion_logprobs(model, batch, temperature=0.9)
    params = lora.trainable_parameters(model)
    grads = torch.autograd.grad((logp * torch.linspace(-1, 1, logp.shape[1])).sum(), params)
    return logp.detach(), ent, grads


@pytest.mark.parametrize("bucket_lengths", [True, False])
def test_fast_path_equals_the_plain_path_and_the_spec(tiny_dir, bucket_lengths):
    """The fast path (each prompt once for its group, the completions in length groups or in one) gives the
    plain path's log-probs, entropies and LoRA gradients, and both give LogprobHead's two-line spec: 4
    prompts of different lengths (left padding) x G=3 rows, completions of 0 to 24 tokens, one with a hole,
    the loss weighing log-probs and (differentiable) entropies."""
    model = lora_model(tiny_dir)
    model.train()
    g = torch.Generator().manual_seed(3)
    p_ids, p_mask = pad_left([*PROMPTS, [16, 17, 18, 19]], 0)
    p_ids, p_mask = p_ids.repeat_interleave(G, 0), p_mask.repeat_interleave(G, 0)  # (12, Tp)
    comp = torch.randint(1, model.config.vocab_size, (12, 24), generator=g)  # (12, 24)
    lens = torch.tensor([2, 3, 24, 1, 4, 2, 0, 3, 5, 2, 2, 17])
    mask = (torch.arange(24)[None, :] < lens[:, None]).float()  # (12, 24)
    mask[1, 1] = 0  # a hole
    batch = make_batch(p_ids, p_mask, comp, mask)
    assert batch.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    head = FastLogprobHead(model)
    head.bucket_lengths = bucket_lengths
    params = lora.trainable_parameters(model)
    w = torch.linspace(-1, 1, 24)  # (Tc,) a weight per column, so every position's gradient counts

    def grads(logp, ent):  # (N, Tc), (N, Tc)
        return torch.autograd.grad((logp * w).sum() + 0.1 * (ent * w.flip(0)).sum(), params)

    calls = []
    hook = model.register_forward_pre_hook(lambda mod, args: calls.append(tuple(args[0].shape)))
    logp, ent = completion_logprobs(head, batch, temperature=0.9, entropy_grad=True)
    hook.remove()
    # the prompts once, then the completions: in 2 length groups (the 8 short rows that need any, the
    # 17- and 24-token ones), or in one of every row
    assert calls == ([(4, 6), (8, 4), (2, 23)] if bucket_lengths else [(4, 6), (12, 23)])
    grads_fast = grads(logp, ent)

    plain = batch.rows(slice(None))
    plain.group = torch.arange(12)  # every row its own prompt: one pass over all tokens, the chunked head
    calls = []
    hook = model.register_forward_pre_hook(lambda mod, args: calls.append(tuple(args[0].shape)))
    logp_one, ent_one = completion_logprobs(head, plain, temperature=0.9, entropy_grad=True)
    hook.remove()
    assert calls == [(12, 6 + 24)]
    grads_one = grads(logp_one, ent_one)

    # the plain path itself (LogprobHead): the same batch, one pass over all tokens, the whole logits
    calls = []
    hook = model.register_forward_pre_hook(lambda mod, args: calls.append(tuple(args[0].shape)))
    logp_plain, ent_plain = completion_logprobs(LogprobHead(model), batch, 0.9, entropy_grad=True)
    hook.remove()
    assert calls == [(12, 6 + 24)]
    grads_plain = grads(logp_plain, ent_plain)

    Tp = batch.prompt_len  # the spec: the [N, Tc, V] float32 logits and their log-softmax
    logits = model(batch.ids, attention_mask=batch.attn, position_ids=batch.pos)[:, Tp - 1 : -1] / 0.9
    logq = logits.float().log_softmax(-1)  # (N, Tc, V)
    logp_spec = logq.gather(-1, batch.targets[..., None])[..., 0] * mask  # (N, Tc)
    ent_spec = -(logq.exp() * logq).sum(-1) * mask  # (N, Tc)
    grads_spec = grads(logp_spec, ent_spec)

    assert (logp[mask == 0] == 0).all() and (logp[mask == 1] != 0).all()
    for got in [
        (logp, ent, grads_fast),
        (logp_one, ent_one, grads_one),
        (logp_plain, ent_plain, grads_plain),
    ]:
        torch.testing.assert_close(got[0], logp_spec, atol=1e-5, rtol=0)
        torch.testing.assert_close(got[1], ent_spec, atol=1e-5, rtol=0)
        for a, b in zip(got[2], grads_spec):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for a, b in zip(grads_fast, grads_plain):  # the fast path against the plain one, directly
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_make_batch_finds_the_groups():
    b = group_batch(100)
    assert b.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert b.rows(slice(2, 5)).group.tolist() == [0, 1, 1]
    # identical prompts that are not adjacent are separate groups
    p_ids, p_mask = pad_left([[1, 2], [3], [1, 2]], 0)
    b = make_batch(p_ids, p_mask, torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2))
    assert b.group.tolist() == [0, 1, 2]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompt_forward_equals_per_row(tiny_dir, checkpointing):
    """Running each prompt once for its group gives the per-row log-probs, entropies and LoRA gradients."""
    model = lora_model(tiny_dir)
    model.activation_checkpointing = checkpointing
    model.train()
    batch = group_batch(model.config.vocab_size)
    calls = []
    hook = model.register_forward_pre_hook(lambda mod, args: calls.append(tuple(args[0].shape)))
    logp, ent, grads = logp_and_grads(FastLogprobHead(model), batch)
    hook.remove()
    # 3 prompts once, then the completions (all but their last token; row 4's one token needs none)
    assert calls == [(3, 6), (8, 5)]

    per_row = group_batch(model.config.vocab_size)
    per_row.group = torch.arange(len(per_row))  # every row its own prompt: one full pass
    logp_ref, ent_ref, grads_ref = logp_and_grads(FastLogprobHead(model), per_row)
    torch.testing.assert_close(logp, logp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)
    assert (logp[batch.mask == 0] == 0).all()
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_shared_prompt_micro_batches_split_groups(tiny_dir):
    """Micro-batches that cut through a group, and one-token completions, still match the per-row path."""
    model = FastLogprobHead(lora_model(tiny_dir))
    batch = group_batch(model.model.config.vocab_size)
    full, _ = completion_logprobs(model, batch)
    parts = torch.cat([completion_logprobs(model, batch.rows(slice(i, i + 4)))[0] for i in range(0, 9, 4)])
    torch.testing.assert_close(parts, full, atol=1e-5, rtol=0)
    one = batch.rows(slice(0, 9))
    one.targets, one.mask = batch.targets[:, :1], batch.mask[:, :1]  # one-token completions
    grouped, _ = completion_logprobs(model, one)
    one.group = torch.arange(9)
    torch.testing.assert_close(grouped, completion_logprobs(model, one)[0], atol=1e-5, rtol=0)


def test_length_buckets_split_off_the_long_rows():
    need = torch.tensor([2] * 31 + [15])  # one group: 32 x 15 = 480 positions; two: 31 x 2 + 15 (+ 2 x 60)
    assert [(r.tolist(), n) for r, n in length_buckets(need)] == [(list(range(31)), 2), ([31], 15)]
    # one length, or a spread too small to pay for a pass: one group; rows that need nothing: none
    assert [(r.tolist(), n) for r, n in length_buckets(torch.tensor([0, 3, 3, 0, 2]))] == [([1, 2, 4], 3)]
    assert length_buckets(torch.tensor([0, 0])) == []
    # a spread that pays for a group where a group costs 32 positions (float32 on a CPU), not where it
    # costs 256 (bf16, GPUs): one group is 32 x 6 = 192 positions, two are 28 x 1 + 4 x 6 = 52
    need = torch.tensor([1] * 28 + [6] * 4)
    assert [n for _, n in length_buckets(need, BUCKET_MIN)] == [1, 6]
    assert [n for _, n in length_buckets(need, BUCKET_MIN_FAST)] == [6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_length_groups_cost_follows_the_matmuls(tiny_dir, dtype, monkeypatch):
    import nanogrpo.model.fast.shared_prompt as sp

    seen = []
    monkeypatch.setattr(sp, "length_buckets", lambda need, m: seen.append(m) or [(torch.arange(9), 5)])
    completion_logprobs(FastLogprobHead(lora_model(tiny_dir, dtype=dtype)), group_batch(1024))
    assert seen == [BUCKET_MIN if dtype == torch.float32 else BUCKET_MIN_FAST]


def _cover_cost(need: list[int], groups) -> int:
    rows = sum(v > 0 for v in need)
    per_group = max(BUCKET_MIN, rows * max(need) // BUCKET_SHARE)
    return sum(len(r) * n + per_group for r, n in groups)


@pytest.mark.parametrize("seed", range(20))
def test_length_buckets_is_the_cheapest_cover(seed):
    """Every row that needs tokens is in exactly one group at least as long as it needs, and no split of
    the sorted lengths into runs (all 2^(D-1) of them, enumerated) costs less."""
    g = torch.Generator().manual_seed(seed)
    need = torch.randint(0, 40, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
    need[torch.rand(len(need), generator=g) < 0.6] //= 8  # long-tailed, as completions are
    groups = length_buckets(need)
    seen = torch.cat([r for r, _ in groups]) if groups else torch.zeros(0, dtype=torch.long)
    assert sorted(seen.tolist()) == (need > 0).nonzero().squeeze(1).tolist()
    assert all(int(need[r].max()) == n for r, n in groups)
    values = sorted({v for v in need.tolist() if v > 0})
    best = None
    for bits in range(2 ** max(len(values) - 1, 0)):
        runs, start = [], 0
        for k in range(len(values)):
            if k == len(values) - 1 or bits >> k & 1:
                lo, hi = values[start], values[k]
                runs.append(([i for i, v in enumerate(need.tolist()) if lo <= v <= hi], hi))
                start = k + 1
        cost = _cover_cost(need.tolist(), runs)
        best = cost if best is None else min(best, cost)
    assert _cover_cost(need.tolist(), groups) == (best or 0)


def test_length_groups_equal_one_group(tiny_dir):
    """Completion rows run in groups of their own lengths (one long completion among short ones, a row with
    nothing to score, a mask with a hole) give the log-probs, entropies and LoRA gradients of one group."""
    model = lora_model(tiny_dir)
    model.train()
    g = torch.Generator().manual_seed(1)
    p_ids, p_mask = pad_left(PROMPTS, 0)
    p_ids, p_mask = p_ids.repeat_interleave(G, 0), p_mask.repeat_interleave(G, 0)  # (9, Tp)
    comp = torch.randint(1, model.config.vocab_size, (9, 40), generator=g)  # (9, 40)
    lens = torch.tensor([3, 2, 4, 40, 3, 2, 0, 3, 5])
    mask = (torch.arange(40)[None, :] < lens[:, None]).float()  # (9, 40)
    mask[2, 1] = 0  # a hole: row 2 still needs its tokens up to its last target
    batch = make_batch(p_ids, p_mask, comp, mask)
    head = FastLogprobHead(model)
    calls = []
    hook = model.register_forward_pre_hook(lambda mod, args: calls.append(tuple(args[0].shape)))
    logp, ent, grads = logp_and_grads(head, batch)
    hook.remove()
    assert calls == [(3, 6), (7, 4), (1, 39)]  # the prompts, the six short rows, the long one
    head.bucket_lengths = False
    logp_ref, ent_ref, grads_ref = logp_and_grads(head, batch)
    torch.testing.assert_close(logp, logp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)
    assert (logp[mask == 0] == 0).all() and (logp[mask == 1] != 0).all()
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_one_group_of_every_row_runs_only_its_length(tiny_dir):
    """Every row of one length, the batch padded wider (the sampler's longest row since dropped): one
    forward of that length over the rows as they are, equal to the per-row full pass."""
    model = lora_model(tiny_dir)
    model.train()
    g = torch.Generator().manual_seed(2)
    p_ids, p_mask = pad_left(PROMPTS, 0)
    p_ids, p_mask = p_ids.repeat_interleave(G, 0), p_mask.repeat_interleave(G, 0)  # (9, Tp)
    comp = torch.randint(1, model.config.vocab_size, (9, 10), generator=g)  # (9, 10)
    mask = (torch.arange(10)[None, :] < 4).float().expand(9, 10).clone()  # (9, 10) 4 tokens each
    batch = make_batch(p_ids, p_mask, comp, mask)
    calls = []
    hook = model.register_forward_pre_hook(lambda mod, args: calls.append(tuple(args[0].shape)))
    logp, ent, grads = logp_and_grads(FastLogprobHead(model), batch)
    hook.remove()
    assert calls == [(3, 6), (9, 3)]  # the prompts, then tokens 0-2 of every row (they predict 1-3)
    batch.group = torch.arange(9)  # every row its own prompt: one full pass each, no groups at all
    logp_ref, ent_ref, grads_ref = logp_and_grads(model, batch)
    torch.testing.assert_close(logp, logp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)
    assert (logp[:, 4:] == 0).all() and (logp[:, :4] != 0).all()
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_fsdp_runs_the_completions_in_one_group(tiny_dir, tmp_path):
    """Under FSDP every rank must run its blocks as often as the others (each run all-gathers them)."""
    import torch.distributed as dist

    from nanogrpo.infra import fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        head = fsdp.shard(FastLogprobHead(Transformer.from_pretrained(tiny_dir)))
        assert head.bucket_lengths is False
    finally:
        dist.destroy_process_group()


def test_prefix_kv_records_then_expands():
    kv = PrefixKV(2)
    k, v = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    assert kv.update(0, k, v)[0] is k  # recording returns the keys as given
    kv.update(1, k, v)
    kv.length = 3
    ex = kv.expand(torch.tensor([0, 0, 1]))
    k2, v2 = ex.update(0, torch.zeros(3, 1, 2, 4), torch.zeros(3, 1, 2, 4))
    assert k2.shape == (3, 1, 5, 4) and torch.equal(k2[1, :, :3], k[0]) and ex.k[0].shape == (3, 1, 3, 4)


@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_equals_sdpa(masked):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in [(5, 6, 1, 8), (5, 2, 7, 8), (5, 2, 7, 8)])
    mask = None
    if masked:
        mask = torch.rand(5, 1, 1, 7, generator=g) > 0.3
        mask[..., -1] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(decode_attention(q, k, v, mask), ref, atol=1e-6, rtol=0)


BF16, FP32 = torch.bfloat16, torch.float32
# bf16 results are compared within bf16 rounding, float32 ones within float32 rounding
TOL = {BF16: dict(atol=0.05, rtol=0.02), FP32: dict(atol=1e-5, rtol=1e-5)}
PACKINGS = packing_params()  # (dtype, packer): bf16 for oneDNN, float32 for oneDNN and for MKL


@pytest.mark.parametrize("dtype, packer", PACKINGS)
def test_packed_linear_equals_linear(dtype, packer, monkeypatch):
    """Any number of rows gives x W^T + b: oneDNN's packed weight (bf16 or float32) serves any count; MKL's
    float32 one serves its own count, fewer rows padded up to it, and other counts through the plain
    modules."""
    from nanogrpo.model.fast.packed import MklPackedLinear, PackedLinear, _fused

    use_packer(monkeypatch, packer)
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 96).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g))
        lin.bias.copy_(torch.randn(96, generator=g))
        ref = lambda x: F.linear(x.double(), lin.weight.double(), lin.bias.double())  # noqa: E731
        packed = _fused([lin], dtype, batch_hint=10)
        assert isinstance(packed, MklPackedLinear if packer == "mkl" else PackedLinear)
        for shape in [(2, 5, 64), (10, 64), (7, 64), (6, 64), (5, 64), (1, 64), (33, 64)]:
            x = torch.randn(shape, generator=g).to(dtype)
            got = packed(x)
            assert got.shape == (*shape[:-1], 96) and got.dtype == dtype
            torch.testing.assert_close(got.double(), ref(x), atol=0.1 if dtype == BF16 else 1e-4, rtol=0.02)
        if packer == "mkl":
            assert packed.rows == 10
            packed.shrunk(6, steps_left=100)  # more than half of 10: padded, not packed again
            assert packed.rows == 10
            packed.shrunk(4, steps_left=REPACK_MIN_STEPS - 1)  # too few steps left to repay packing
            assert packed.rows == 10
            torch.testing.assert_close(packed(x[:4]).double(), ref(x[:4]), atol=1e-4, rtol=0.02)  # plain
            packed.shrunk(4, steps_left=REPACK_MIN_STEPS)  # half or less: packed again for 4 rows
            assert packed.rows == 4
            x = torch.randn(4, 64, generator=g)
            torch.testing.assert_close(packed(x).double(), ref(x), atol=1e-4, rtol=0.02)
            packed.shrunk(1, steps_left=100)  # one row is a matrix-vector product: not packed for it
            assert packed.rows == 4


@pytest.mark.parametrize("dtype, packer", PACKINGS)
def test_packed_weights_fold_lora_and_restore(tiny_dir, dtype, packer, monkeypatch):
    """Inside the block each projection applies W + BA (one packed matmul); after it, the plain modules."""
    use_packer(monkeypatch, packer)
    model = lora_model(tiny_dir, dtype=dtype)
    x = torch.randn(4, model.config.hidden_size).to(dtype)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    proj = attn.o_proj
    xo = torch.randn(4, proj.in_features).to(dtype)
    with torch.no_grad():
        before, qkv = proj(xo), torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1)
        with packed_weights(model, batch_hint=4) as packed:
            assert packed is not None and attn.o_proj is not proj and attn.o_proj in packed.projections
            inside = attn.o_proj(xo)
            qkv_in, gate_up_in = attn.packed_qkv(x), mlp.packed_gate_up(x)
            logits = packed.head(x)
        after = proj(xo)
    assert torch.equal(before, after) and attn.o_proj is proj
    assert attn.packed_qkv is None and mlp.packed_gate_up is None
    for got, want in [(inside, before), (qkv_in, qkv), (gate_up_in, gate_up)]:
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(logits.float(), (x @ model.lm_head_weight.T).float(), **TOL[dtype])
    with lora.disabled(model), torch.no_grad(), packed_weights(model, batch_hint=4):
        base = attn.o_proj(xo)  # a disabled adapter is not folded in
    torch.testing.assert_close(base.float(), proj.base_layer(xo).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype, packer", PACKINGS)
def test_packed_lm_head_follows_the_weight_and_is_freed_on_exit(tiny_dir, dtype, packer, monkeypatch):
    """The LM head is packed from its weight at every call, frozen (as under LoRA) or not: after an in-place
    update the next call computes with the new values; and on the way out the copies are freed even when
    the caller still holds what was yielded (they would otherwise stay live through the training pass)."""
    use_packer(monkeypatch, packer)
    model = Transformer.from_pretrained(tiny_dir, dtype=dtype)
    model.lm_head_weight.requires_grad_(False)  # frozen, as under LoRA
    x = torch.randn(4, model.config.hidden_size).to(dtype)
    want = lambda: (x @ model.lm_head_weight.T).float()  # noqa: E731
    with torch.no_grad():
        with packed_weights(model, batch_hint=4) as first:
            first.shrunk(2, steps_left=100)  # a float32 head ends the call packed for 2 rows
            torch.testing.assert_close(first.head(x[:2]).float(), want()[:2], **TOL[dtype])
        assert first.head is None and first.projections == []
        model.lm_head_weight.mul_(-1.0)  # as an update of a trained head would
        with packed_weights(model, batch_hint=4) as second:
            torch.testing.assert_close(second.head(x).float(), want(), **TOL[dtype])


def test_packing_hands_free_pages_back_as_it_opens_and_closes(tiny_dir, monkeypatch):
    """The packing block trims the heap before the copies are made and after they are freed (so they and
    the training pass's activations do not add up), and not at all when packing does not apply."""
    import nanogrpo.model.fast.packed as packed_mod

    model = Transformer.from_pretrained(tiny_dir, dtype=torch.float32)
    applies = packing_supported(model.lm_head_weight)  # float32: where oneDNN's or MKL's packing runs
    calls = []
    monkeypatch.setattr(packed_mod, "release_free_heap", lambda: calls.append("trim"))
    with torch.no_grad(), packed_weights(model, batch_hint=4) as packed:
        assert (packed is not None) == applies and len(calls) == applies
    assert len(calls) == 2 * applies
    monkeypatch.setenv("NANOGRPO_PACKED", "0")
    with torch.no_grad(), packed_weights(model, batch_hint=4) as packed:
        assert packed is None
    assert len(calls) == 2 * applies


@pytest.mark.parametrize("dtype, packer", PACKINGS)
def test_cpu_sampling_matches_plain_path(tiny_dir, monkeypatch, dtype, packer):
    """The packed weights (+ the float32 cache for bf16) sample what the plain path samples (greedy: the
    same tokens; sampled: log-probs within rounding), with LoRA on, and with an EOS that ends rows early so
    the batch shrinks (and MKL's float32 weights are packed again for it)."""
    use_packer(monkeypatch, packer)
    model = lora_model(tiny_dir, dtype=dtype)
    # ends: the greedy tokens of prompts 0 and 1 (6 of the 9 rows end at once, so the batch drops to 3 and
    # float32 weights are packed again) and one id in nine (sampled rows end at random steps)
    kw = dict(group_size=G, max_new_tokens=12, pad_id=0, eos_ids=[10, 12, *range(100, 1024, 9)])
    monkeypatch.setenv("NANOGRPO_PACKED", "0")
    plain = generate(model, PROMPTS, temperature=0.0, **kw)
    plain_s = generate(model, PROMPTS, temperature=1.0, generator=torch.Generator().manual_seed(1), **kw)
    monkeypatch.delenv("NANOGRPO_PACKED")
    shrunk, original = [], Packed.shrunk

    def spy(self, rows, steps_left):
        shrunk.append(rows)
        original(self, rows, steps_left)

    monkeypatch.setattr(Packed, "shrunk", spy)
    fast = generate(model, PROMPTS, temperature=0.0, **kw)
    fast_s = generate(model, PROMPTS, temperature=1.0, generator=torch.Generator().manual_seed(1), **kw)
    assert shrunk and min(shrunk) <= 4, f"batch sizes after drops {shrunk}: the test must shrink the batch"
    agree = (fast.completion_ids == plain.completion_ids).float().mean()
    if dtype == FP32:
        assert torch.equal(fast.completion_ids, plain.completion_ids) and torch.equal(fast.mask, plain.mask)
    else:
        assert agree > 0.9, f"greedy tokens agree on {agree:.0%} only"
    same = fast_s.completion_ids == plain_s.completion_ids  # (N, T) the same draws up to a flipped token
    first_diff = (~same).float().cumsum(1) == 0
    torch.testing.assert_close(
        fast_s.logp[first_diff], plain_s.logp[first_diff], atol=0.05 if dtype == BF16 else 1e-4, rtol=0
    )
    if dtype == FP32:
        assert same.all(), "float32: the packed path draws the same tokens"


@pytest.mark.parametrize("dtype, packer", PACKINGS)
def test_fused_projections_keep_biases(dtype, packer, monkeypatch):
    """q|k|v fused: Qwen2's q/k/v biases (and a missing bias as zeros) land in the right columns."""
    from nanogrpo.model.fast.packed import _fused

    use_packer(monkeypatch, packer)
    torch.manual_seed(0)
    mods = [torch.nn.Linear(32, n, bias=b).to(dtype) for n, b in [(32, True), (16, False), (16, True)]]
    x = torch.randn(3, 32).to(dtype)
    with torch.no_grad():
        want = torch.cat([m(x) for m in mods], -1)
        got = _fused(mods, dtype, batch_hint=3)(x)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_float32_sampling_without_float32_packing(tiny_dir, monkeypatch):
    """Where neither oneDNN's nor MKL's float32 packing runs (a torch without MKL and oneDNN), float32
    samples on the plain weights, the same tokens."""
    from nanogrpo.infra import cpu

    model = lora_model(tiny_dir)
    want = generate(model, PROMPTS, group_size=G, max_new_tokens=6, temperature=0.0, pad_id=0)
    cpu.cpu_capability.cache_clear()
    monkeypatch.setattr(cpu.torch.backends.mkl, "is_available", lambda: False)
    monkeypatch.setattr(cpu.torch.backends.mkldnn, "is_available", lambda: False)
    try:
        assert cpu.cpu_capability().fp32_packing is None and not packing_supported(torch.zeros(1))
        with torch.no_grad(), packed_weights(model, batch_hint=9) as packed:
            assert packed is None
        got = generate(model, PROMPTS, group_size=G, max_new_tokens=6, temperature=0.0, pad_id=0)
    finally:
        cpu.cpu_capability.cache_clear()
    assert torch.equal(got.completion_ids, want.completion_ids)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, packer", [p for p in PACKINGS if p.values[0] == FP32])
def test_float32_packed_sampling_is_the_plain_path_on_smollm2(smollm2_dir, monkeypatch, dtype, packer):
    """SmolLM2 in float32: 4 chat prompts x 2 greedy rows with its EOS, packed for oneDNN or for MKL (the
    batch shrinks as answers end) and plain, give the same tokens."""
    from transformers import AutoTokenizer

    use_packer(monkeypatch, packer)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = ["What is 2 + 3?", "Name a color.", "What is the capital of Italy?", "Say hi."]
    chats = [[{"role": "user", "content": q}] for q in questions]
    prompts = [
        tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)) for c in chats
    ]
    model = Transformer.from_pretrained(smollm2_dir, dtype=FP32)
    kw = dict(group_size=2, max_new_tokens=32, temperature=0.0, eos_ids=[tok.eos_token_id], pad_id=0)
    fast = generate(model, prompts, **kw)
    monkeypatch.setenv("NANOGRPO_PACKED", "0")
    plain = generate(model, prompts, **kw)
    assert torch.equal(fast.completion_ids, plain.completion_ids) and torch.equal(fast.mask, plain.mask)
    assert int((fast.lengths < 31).sum()) >= 2, (
        "fewer than a quarter of the rows ended: the batch never shrank"
    )


def test_plain_head_equals_the_chunked_head_under_autocast(tiny_dir):
    """Under bf16 autocast both heads take the logits of hidden states and LM head cast to bf16: the plain
    path's whole-logits log-softmax and the chunked one agree."""
    model = lora_model(tiny_dir)
    batch = group_batch(model.config.vocab_size)
    got = {}
    for fast in (True, False):
        logp, ent = completion_logprobs(
            (FastLogprobHead if fast else LogprobHead)(model), batch, 0.9, torch.bfloat16
        )
        got[fast] = (logp, ent)
    torch.testing.assert_close(got[True][0], got[False][0], atol=2e-2, rtol=0)
    torch.testing.assert_close(got[True][1], got[False][1], atol=2e-2, rtol=0)
    assert (got[True][0] != 0).sum() == batch.mask.sum()
