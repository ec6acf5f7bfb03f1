"""nanogrpo/model/attention.py: the GPU path of grouped-query attention with a padding mask (k/v repeated so a
fused kernel takes the mask), the CPU paths left as they were, and `--model.attn flash` (start-up refusals,
and the varlen glue through a stand-in `flash_attn` module that computes with SDPA).

The GPU path is compared on the CPU against the call it replaces, in float64. Whether a fused kernel takes
a call is torch's C++ checks (`torch.backends.cuda.can_use_*_attention`): on a CPU build they answer False
for any input, so the `gpu` tests at the end check the kernel choice where the checks are real.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from nanogrpo.config import ModelConfig, TrainConfig
from nanogrpo.infra.flag_checks import check_config
from nanogrpo.model.attention import (
    Varlen,
    check_flash,
    decode_attention,
    fused_takes,
    gqa_sdpa,
    kernel_attention,
    repeat_kv,
    varlen,
)
from nanogrpo.model.fast.kvcache import PrefixKV
from nanogrpo.model.hf_config import ModelArgs
from nanogrpo.model.transformer import Transformer, attention
from train import main as train_main

CUDA = torch.cuda.is_available()


def gpu(test):
    """A test that needs CUDA: marked `gpu`, skipped without it."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs CUDA")(test))


def old_attention(q, k, v, mask):
    """attention() as it was before the GPU path (no flash): the reference for the CPU paths."""
    T = q.shape[2]
    causal, mask = isinstance(mask, str), mask if isinstance(mask, torch.Tensor) else None
    dtype = q.dtype
    if q.device.type == "cpu" and (dtype != torch.float32 or k.dtype != torch.float32):
        q, k, v = q.float(), k.float(), v.float()
    if T == 1 and q.device.type == "cpu":
        y = decode_attention(q, k, v, mask)
    else:
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
        )
    return y.transpose(1, 2).to(dtype)


def padding_mask(lens: list[int], T: int, S: int, device="cpu") -> torch.Tensor:
    """The model's boolean mask (B, 1, T, S) for left-padded rows of real lengths `lens` (of S), with the
    queries the last T positions: causal, pads hidden, each query sees itself."""
    am = torch.stack([torch.arange(S, device=device) >= S - n for n in lens])  # (B, S)
    qpos = torch.arange(S - T, S, device=device)[:, None]  # (T, 1)
    kpos = torch.arange(S, device=device)[None, :]  # (1, S)
    return ((kpos <= qpos)[None, None] & am[:, None, None, :]) | (kpos == qpos)  # (B, 1, T, S)


def qkv(B, nh, nkv, T, S, D, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    return make(B, nh, T, D), make(B, nkv, S, D), make(B, nkv, S, D)


# the calls the trainer makes: (T, S, lens or None, causal); lens are left-padded rows' real lengths
CALLS = {
    "padding mask": (12, 12, [12, 9, 4], False),  # a training forward / prefill of left-padded rows
    "causal": (12, 12, None, True),  # no padding, no cache
    "decode": (1, 12, [12, 7, 3], False),  # one new token per row after a cache
    "block after a prefix": (5, 12, [12, 9, 6], False),  # PrefixKV: completions after shared prompts
}


@pytest.mark.parametrize("call", CALLS)
def test_gpu_path_equals_the_old_call(call):
    """The repeated-k/v call (what CUDA runs) against the enable_gqa call it replaces: outputs and the
    gradients of q, k and v, float64 on both sides; and float32 against that float64 reference."""
    T, S, lens, causal = CALLS[call]
    mask = None if lens is None else padding_mask(lens, T, S)
    q, k, v = qkv(3, 6, 2, T, S, 16)
    assert not fused_takes(q, k, v, mask, causal)  # on the CPU: the repeat is what runs below
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    new = gqa_sdpa(q, k, v, mask, causal)
    torch.testing.assert_close(new, ref, atol=1e-12, rtol=0)
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    g_new = torch.autograd.grad((new * w).sum(), (q, k, v))
    for a, b in zip(g_new, g_ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    new32 = gqa_sdpa(q32, k32, v32, mask, causal)
    torch.testing.assert_close(new32.double(), ref, atol=2e-6, rtol=0)
    g32 = torch.autograd.grad((new32 * w.float()).sum(), (q32, k32, v32))
    for a, b in zip(g32, g_ref):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=0)


def test_repeat_kv_pairs_heads_as_enable_gqa():
    """Query head h reads KV head h // g, as SDPA's enable_gqa (a repeat_interleave) pairs them."""
    x = torch.randn(2, 3, 5, 4)
    torch.testing.assert_close(repeat_kv(x, 4), x.repeat_interleave(4, dim=1), atol=0, rtol=0)
    assert repeat_kv(x, 4).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("call", CALLS)
def test_cpu_paths_unchanged(call, dtype):
    """On the CPU attention() is the old function, bit for bit (float32 cast, decode matmuls, SDPA), and
    plain SDPA's result in float64 to the dtype's rounding."""
    T, S, lens, causal = CALLS[call]
    mask = "causal" if causal else padding_mask(lens, T, S)
    q, k, v = (t.detach().to(dtype) for t in qkv(3, 6, 2, T, S, 16))
    torch.testing.assert_close(attention(q, k, v, mask), old_attention(q, k, v, mask), atol=0, rtol=0)
    ref = F.scaled_dot_product_attention(
        q.double(),
        k.double(),
        v.double(),
        attn_mask=None if causal else mask,
        is_causal=causal,
        enable_gqa=True,
    ).transpose(1, 2)  # (B, T, nh, D)
    atol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding, 2^-8 of values ~1
    torch.testing.assert_close(attention(q, k, v, mask).double(), ref, atol=atol, rtol=0)


def test_sdpa_runs_as_it_is_only_where_no_kernel_is_faster(monkeypatch):
    """kernel_attention hands a call back to attention's own SDPA call (None) exactly when it is a float32
    CPU call of several queries or a GPU call (the meta device stands in) with as many KV heads as query
    heads; a GPU grouped-query call reaches gqa_sdpa, and the model's output is SDPA's either way."""
    import nanogrpo.model.attention as attention_py

    routed = []
    monkeypatch.setattr(attention_py, "gqa_sdpa", lambda q, k, v, mask, causal: routed.append(1) or q)
    mask = padding_mask([5, 3], 5, 5)  # (2, 1, 5, 5)
    for nkv, device, dtype, T, plain in [
        (4, "cpu", torch.float32, 5, True),
        (2, "cpu", torch.float32, 5, True),
        (2, "cpu", torch.float32, 1, False),  # decode_attention
        (4, "cpu", torch.bfloat16, 5, False),  # cast to float32
        (4, "meta", torch.bfloat16, 5, True),
        (2, "meta", torch.bfloat16, 5, False),  # gqa_sdpa
    ]:
        q = torch.zeros(2, 4, T, 8, dtype=dtype, device=device)
        k = v = torch.zeros(2, nkv, 5, 8, dtype=dtype, device=device)
        m = mask[:, :, -T:].to(device)
        assert (kernel_attention(q, k, v, m) is None) == plain, (nkv, device, dtype, T)
        assert attention(q, k, v, m).shape == (2, T, 4, 8)
    assert len(routed) == 2  # the meta GQA call, once from each of the two calls above


def test_fused_checks_answer_false_off_cuda():
    """torch's kernel checks take the trainer's shapes (SDPAParams' 7 arguments: q, k, v, mask, dropout,
    is_causal, enable_gqa) and answer False for CPU tensors: on a CPU build for any input (the checks are
    stubs there), on a CUDA build because the tensors are not on the GPU. So the CPU tests above always run
    the repeated-k/v call, and the kernel choice itself is checked by the gpu tests below."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    q, k, v = (t.detach().to(torch.bfloat16) for t in qkv(2, 12, 2, 64, 64, 128))
    mask = padding_mask([64, 40], 64, 64)
    for params in (
        SDPAParams(q, k, v, mask, 0.0, False, True),  # the old call
        SDPAParams(q, repeat_kv(k, 6), repeat_kv(v, 6), mask, 0.0, False, False),  # the new call
        SDPAParams(q, repeat_kv(k, 6), repeat_kv(v, 6), None, 0.0, True, False),  # plain causal attention
    ):
        assert not can_use_flash_attention(params, False)
        assert not can_use_efficient_attention(params, False)


# ---------------------------------------------------------------------------------------------------------
# --model.attn flash: refusals at start-up, and the dispatch through a stand-in flash_attn


def fake_flash_attn(calls: list) -> types.ModuleType:
    """A `flash_attn` module whose two functions compute with SDPA (float64 inside), with flash-attn's
    layouts, causal alignment (bottom-right) and dtype rule (fp16/bf16 only); `calls` records each call."""

    def check(*ts):
        for t in ts:
            if t.dtype not in (torch.float16, torch.bfloat16):
                raise RuntimeError("FlashAttention only support fp16 and bf16 data type")

    def attend(q, k, v, causal):  # q (T, h, D), k/v (S, h_kv, D)
        T, S = q.shape[0], k.shape[0]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T) if causal else None
        q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (h, T, D)
        return y.transpose(0, 1)

    def flash_attn_func(q, k, v, causal=False):  # (B, T, h, D)
        check(q, k, v)
        calls.append(("func", q.dtype, tuple(q.shape)))
        return torch.stack([attend(q[b], k[b], v[b], causal) for b in range(len(q))]).to(q.dtype)

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):  # (total, h, D)
        check(q, k, v)
        assert cu_q.dtype == cu_k.dtype == torch.int32
        calls.append(("varlen", q.dtype, tuple(q.shape)))
        cq, ck = cu_q.tolist(), cu_k.tolist()
        assert max_q == max(b - a for a, b in zip(cq, cq[1:])) and max_k == max(
            b - a for a, b in zip(ck, ck[1:])
        )
        parts = [attend(q[a:b], k[c:d], v[c:d], causal) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]
        return torch.cat(parts).to(q.dtype)

    mod = types.ModuleType("flash_attn")
    mod.flash_attn_func, mod.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return mod


@pytest.fixture
def flash_calls(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn(calls))
    return calls


@pytest.fixture
def no_flash(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError


def test_flash_refused_without_flash_attn(no_flash, tmp_path):
    with pytest.raises(
        ValueError, match="needs flash-attn.*pip install 'nanogrpo\\[gpu\\]'.*--model.attn sdpa"
    ):
        check_flash("cuda", "bfloat16")
    with pytest.raises(ValueError, match="needs flash-attn"):  # train.py's start-up checks, before any load
        train_main(TrainConfig(model=ModelConfig(attn="flash", device="cuda")))
    # the model refuses before reading anything: this folder does not even exist
    with pytest.raises(ValueError, match="needs flash-attn"):
        Transformer.from_pretrained(tmp_path / "missing", attn="flash")


def test_flash_refused_on_the_cpu_and_in_float32(flash_calls):
    with pytest.raises(ValueError, match="CUDA GPUs only.*--model.attn sdpa"):
        check_flash("cpu", "bfloat16")
    if not CUDA:
        with pytest.raises(ValueError, match="CUDA GPUs only"):
            check_flash("auto", "auto")
    with pytest.raises(ValueError, match="fp16/bf16 only.*--model.dtype bfloat16"):
        check_flash("cuda", "float32")
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        train_main(TrainConfig(model=ModelConfig(attn="flash", device="cpu")))
    check_flash("cuda", "auto")  # a GPU run in bf16: accepted
    check_flash("cuda:1", "bfloat16")
    check_config(TrainConfig(model=ModelConfig(attn="sdpa", device="cpu")))  # sdpa is never refused


def test_varlen_indices():
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])  # (3, 5) left padding
    vl = varlen(am, 2, torch.ones(3, 1, 2, 5, dtype=torch.bool))  # the last 2 positions are queries
    assert vl.q_idx.tolist() == [0, 1, 2, 3, 5]  # row 2's first query (position 3) is a pad
    assert vl.k_idx.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 14]
    assert vl.cu_q.tolist() == [0, 2, 4, 5] and vl.cu_k.tolist() == [0, 3, 8, 9]
    assert (vl.max_q, vl.max_k) == (2, 5) and vl.cu_q.dtype == torch.int32


def small_model(dtype=torch.float32, nh=4, nkv=2) -> Transformer:
    torch.manual_seed(0)
    a = ModelArgs(
        vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=nh, num_key_value_heads=nkv, head_dim=16,
    )  # fmt: skip
    return Transformer(a).to(dtype).eval()


def left_padded(lens: list[int], L: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 61, (len(lens), L), generator=torch.Generator().manual_seed(1))
    am = torch.stack([torch.arange(L) >= L - n for n in lens]).long()  # (B, L)
    return ids, am


def test_flash_dispatch_padded_and_unpadded(flash_calls):
    """A left-padded batch runs the varlen kernel on its real tokens and an unpadded one flash_attn_func;
    the real tokens' hidden states equal the SDPA model's (bf16 rounding: the two compute differently)."""
    model = small_model(torch.bfloat16)
    ids, am = left_padded([9, 6, 2], 9)
    with torch.no_grad():
        ref = model(ids, attention_mask=am, return_hidden=True)  # (B, L, H)
        model.set_attn("flash")
        out = model(ids, attention_mask=am, return_hidden=True)
        assert [c[0] for c in flash_calls] == ["varlen"] * 2  # one call per layer
        assert flash_calls[0][2] == (9 + 6 + 2, 4, 16)  # only the real tokens, packed
        real = am.bool()
        torch.testing.assert_close(out[real].float(), ref[real].float(), atol=0.05, rtol=0.05)
        flash_calls.clear()
        out = model(ids, return_hidden=True)  # no padding
        model.set_attn("sdpa")
        ref = model(ids, return_hidden=True)
    assert [c[0] for c in flash_calls] == ["func"] * 2
    torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.05)


def test_flash_after_a_prefix(flash_calls):
    """The training forward's shared prompts: a prefix pass, then completions that attend to the prompt's
    real keys and causally to their own (a query block shorter than its keys: causal bottom-right)."""
    model = small_model(torch.bfloat16)
    ids, am = left_padded([8, 5, 3], 8)  # the prompts
    ids = torch.cat([ids, ids[:, :4].flip(0)], 1)  # + 4 completion tokens each, all real
    am = torch.cat([am, torch.ones_like(am[:, :4])], 1)  # (3, 12)
    Tp, outs = 8, []
    for attn in ("sdpa", "flash"):
        model.set_attn(attn)
        with torch.no_grad():
            prefix = PrefixKV(2)
            model(ids[:, :Tp], attention_mask=am[:, :Tp], kv_cache=prefix, return_hidden=True)
            pos = (am.cumsum(-1) - 1).clamp(min=0)
            rest = model(
                ids[:, Tp:], attention_mask=am, position_ids=pos[:, Tp:],
                kv_cache=prefix.expand(torch.arange(3)), return_hidden=True,
            )  # fmt: skip
        outs.append(rest.float())
    assert [c[0] for c in flash_calls] == ["varlen"] * 4  # 2 layers x (prefix, completions)
    assert flash_calls[-1][2] == (3 * 4, 4, 16)  # the completion tokens, all real
    torch.testing.assert_close(outs[1], outs[0], atol=0.05, rtol=0.05)


def test_flash_float32_calls_run_sdpa(flash_calls):
    """flash-attn has no float32 kernel: a float32 call (float32 weights without autocast) runs SDPA with
    the same mask, bit for bit the sdpa model's; under autocast (a full fine-tune: float32 weights) the
    call is cast to autocast's dtype, as SDPA's autocast would, and runs flash-attn."""
    model = small_model(torch.float32)
    ids, am = left_padded([9, 6, 2], 9)
    with torch.no_grad():
        ref = model(ids, attention_mask=am, return_hidden=True)
        model.set_attn("flash")
        out = model(ids, attention_mask=am, return_hidden=True)
        assert flash_calls == []
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        out_nopad = model(ids[:, 3:], return_hidden=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_ac = model(ids, attention_mask=am, return_hidden=True)
    model.set_attn("sdpa")
    with torch.no_grad():
        torch.testing.assert_close(out_nopad, model(ids[:, 3:], return_hidden=True), atol=0, rtol=0)
    assert flash_calls and all(c[0] == "varlen" and c[1] == torch.bfloat16 for c in flash_calls)
    real = am.bool()
    torch.testing.assert_close(out_ac[real].float(), ref[real], atol=0.05, rtol=0.05)


def test_flash_fallback_block_after_a_cache(flash_calls):
    """The "flash" mask (no padding) of a query block after a cache, in float32: SDPA with the causal mask
    aligned bottom-right, as flash-attn aligns it."""
    q, k, v = (t.detach().float() for t in qkv(2, 4, 2, 3, 7, 16))
    want = attention(q, k, v, torch.ones(3, 7, dtype=torch.bool).tril(4)[None, None])
    torch.testing.assert_close(attention(q, k, v, "flash"), want, atol=0, rtol=0)
    assert flash_calls == []
    got = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), "flash")  # now flash-attn
    assert flash_calls == [("func", torch.bfloat16, (2, 3, 4, 16))]
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)


def test_varlen_mask_is_a_plain_tensor_for_decode_steps(flash_calls):
    """Decode steps (T = 1) keep the boolean mask: the sampler's GroupedKVCache reads only tensors."""
    model = small_model(torch.bfloat16)
    model.set_attn("flash")
    seen = []
    real_attend = PrefixKV.attend

    def spy(self, layer, q, k, v, mask):
        seen.append(type(mask))
        return real_attend(self, layer, q, k, v, mask)

    ids, am = left_padded([5, 3], 6)
    cache = PrefixKV(2)
    cache.attend = types.MethodType(spy, cache)
    with torch.no_grad():
        model(ids[:, :5], attention_mask=am[:, :5], kv_cache=cache)
        frozen = cache.expand(torch.arange(2))
        frozen.attend = types.MethodType(spy, frozen)
        model(ids[:, 5:], attention_mask=am, kv_cache=frozen)
    assert seen == [Varlen, Varlen, torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------------------------
# on a GPU: the kernel SDPA picks (skipped without CUDA)

B, NH, NKV, D, L = 4, 12, 2, 128, 256  # Qwen2.5-1.5B's heads, a left-padded micro-batch
LENS = [256, 200, 129, 37]


def gpu_call(dtype=torch.bfloat16, T=L):
    q, k, v = qkv(B, NH, NKV, T, L, D, dtype=dtype, device="cuda")
    return q, k, v, padding_mask(LENS, T, L, device="cuda")


@gpu
def test_kernel_checks_on_the_gpu():
    """torch's own checks: the old call (mask + enable_gqa, 12 vs 2 heads) is rejected by flash (it takes
    no mask) and, on torch without GQA in its memory-efficient kernel (2.11), by that one too; the repeated
    call is accepted by the memory-efficient kernel; and attention() never makes a call that both reject."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    q, k, v, mask = gpu_call()
    old = SDPAParams(q, k, v, mask, 0.0, False, True)
    new = SDPAParams(q, repeat_kv(k, NH // NKV), repeat_kv(v, NH // NKV), mask, 0.0, False, False)
    assert not can_use_flash_attention(old, True)
    assert can_use_efficient_attention(new, True)
    native = can_use_efficient_attention(old, False)
    print(f"torch {torch.__version__}: memory-efficient kernel takes masked GQA as it is: {native}")
    assert fused_takes(q, k, v, mask, False) == native  # attention() repeats k/v exactly when it must


@gpu
@pytest.mark.parametrize("call", ["padding mask", "decode", "block after a prefix", "causal", "autocast"])
def test_attention_runs_on_fused_kernels(call):
    """attention() at training shapes, forward and backward, with only the fused kernels enabled (SDPA
    raises when only math could run), equal to the math kernel's float32 result to bf16 rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    T = {"decode": 1, "block after a prefix": 64}.get(call, L)
    q, k, v, mask = gpu_call(T=T)
    m = "causal" if call == "causal" else mask
    with sdpa_kernel([SDPBackend.MATH]):
        ref = old_attention(q.float(), k.float(), v.float(), m)
    if call == "autocast":  # a full fine-tune: float32 q/k after RoPE, bf16 v, under autocast
        q, k = q.detach().float().requires_grad_(), k.detach().float().requires_grad_()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=call == "autocast"):
            y = attention(q, k, v, m)  # (B, T, nh, D)
            y.float().square().sum().backward()
    assert q.grad is not None and k.grad is not None and torch.isfinite(q.grad).all()
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)


@gpu
def test_default_dispatch_avoids_math():
    """Without restrictions SDPA picks its own kernel: the profiler names it; never the math one."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, mask = gpu_call()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attention(q, k, v, mask).float().sum().backward()
    ops = {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}
    print("SDPA ops:", sorted(ops))
    assert ops and not any("math" in op for op in ops)


@gpu
def test_model_training_forward_on_fused_kernels():
    """The training forward of a GQA model (left-padded prompts run once, completions after them as in
    logprobs' shared-prompt path), forward and backward, with only the fused kernels enabled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    a = ModelArgs(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    model = Transformer(a).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (4, 96), device="cuda")
    am = torch.stack([torch.arange(96, device="cuda") >= 64 - n for n in (64, 40, 17, 3)]).long()
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        prefix = PrefixKV(2)
        h = model(ids[:, :64], attention_mask=am[:, :64], position_ids=pos[:, :64], kv_cache=prefix)
        rows = torch.arange(4, device="cuda")  # each row its own prompt
        rest = model(ids[:, 64:], attention_mask=am, position_ids=pos[:, 64:], kv_cache=prefix.expand(rows))
        (h.float().logsumexp(-1).sum() + rest.float().logsumexp(-1).sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
