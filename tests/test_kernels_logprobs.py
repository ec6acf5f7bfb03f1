"""nanogrpo_kernels.logprobs against float64 log_softmax + gather: the chunked reference and the Triton
kernels.

On a machine without CUDA, importing `nanogrpo_kernels` turns on Triton's interpreter (TRITON_INTERPRET=1),
so the Triton kernels run here on CPU tensors; with CUDA they run compiled on the GPU. If triton was imported
before `nanogrpo_kernels` on a CPU machine (the interpreter then off), this module re-runs itself in a
subprocess.
"""

import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import nanogrpo_kernels
from nanogrpo_kernels.logprobs import LogprobsFunction, logprobs_torch, token_logprobs
from nanogrpo_kernels.logprobs_tiles import CPU_CONFIG, GPU_CONFIGS, gpu_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = nanogrpo_kernels.HAS_TRITON and (DEV == "cuda" or nanogrpo_kernels.interpreting())
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="Triton kernels cannot run in this process")
BV = CPU_CONFIG["BLOCK_V"]


@contextmanager
def backend(name: str):
    old = nanogrpo_kernels._backend
    nanogrpo_kernels.set_backend(name)
    try:
        yield
    finally:
        nanogrpo_kernels._backend = old


def make(n, h, v, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5 * 3  # logits of std ~3: a peaked softmax
    targets = torch.randint(0, v, (n,), generator=g)
    # targets on the vocabulary tile edges, and the last (partial) tile
    edges = [0, BV - 1, BV, 2 * BV - 1, 2 * BV, v - 1, v - 2, (v // BV) * BV]
    for i, e in enumerate(edges[: n // 2]):
        targets[2 * i] = min(e, v - 1)
    return hidden.to(device, dtype), weight.to(device, dtype), targets.to(device)


def oracle(hidden, weight, targets, temperature, grad_out):
    """float64 log_softmax + gather, its entropy, and the grads of sum(grad_out * logp)."""
    h = hidden.detach().double().cpu().requires_grad_()
    w = weight.detach().double().cpu().requires_grad_()
    logits = h @ w.T / temperature  # (N, V)
    logsm = logits.log_softmax(-1)
    logp = logsm.gather(1, targets.cpu()[:, None]).squeeze(1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    gh, gw = torch.autograd.grad((logp * grad_out.double().cpu()).sum(), (h, w))
    return logp.detach(), entropy.detach(), gh, gw


def run(fn, hidden, weight, targets, temperature, grad_out):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, entropy = fn(h, w, targets, temperature)
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    assert not entropy.requires_grad, "entropy is a metric: returned detached"
    (logp * grad_out).sum().backward()
    return logp.detach(), entropy, h.grad, w.grad


def token_mean_grad(n: int) -> torch.Tensor:
    """d loss / d logp of a token-mean loss with random advantages: the scale the trainer back-propagates.
    (With O(1) weights per token, float32 sums over N tokens alone exceed an absolute 1e-5.)"""
    return torch.randn(n, generator=torch.Generator().manual_seed(n)) / n


SHAPES = [(37, 48, 1000), (64, 64, 4097), (5, 128, 1000)]  # N not a multiple of the token tile; V not of 128


def check(got, want, tol):
    for name, a, b in zip(("logp", "entropy", "grad hidden", "grad weight"), got, want):
        err = (a.double().cpu() - b).abs().max().item()
        assert err <= tol, f"{name}: max abs error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("n,h,v", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_matches_float64(n, h, v, temperature):
    hidden, weight, targets = make(n, h, v)
    grad_out = token_mean_grad(n)
    # chunk_elems smaller than N * V forces several token chunks
    fn = lambda h_, w_, t_, temp: logprobs_torch(h_, w_, t_, temp, chunk_elems=7 * v)
    check(
        run(fn, hidden, weight, targets, temperature, grad_out),
        oracle(hidden, weight, targets, temperature, grad_out),
        1e-5,
    )


@needs_triton
@pytest.mark.parametrize("n,h,v", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_matches_float64(n, h, v, temperature):
    hidden, weight, targets = make(n, h, v, device=DEV)
    grad_out = token_mean_grad(n).to(DEV)
    # a small backward chunk: several launches, the last one partial
    fn = lambda h_, w_, t_, temp: LogprobsFunction.apply(h_, w_, t_, temp, 20 * v)
    check(
        run(fn, hidden, weight, targets, temperature, grad_out),
        oracle(hidden, weight, targets, temperature, grad_out),
        1e-5,
    )


def entropy_oracle(hidden, weight, targets, temperature, g_logp, g_ent):
    """float64 grads of sum(g_logp * logp + g_ent * H), H = -sum q log q from an explicit log_softmax."""
    h = hidden.detach().double().cpu().requires_grad_()
    w = weight.detach().double().cpu().requires_grad_()
    logsm = (h @ w.T / temperature).log_softmax(-1)  # (N, V)
    logp = logsm.gather(1, targets.cpu()[:, None]).squeeze(1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    loss = (logp * g_logp.double().cpu()).sum() + (entropy * g_ent.double().cpu()).sum()
    return torch.autograd.grad(loss, (h, w))


def entropy_grads(fn, hidden, weight, targets, temperature, g_logp, g_ent):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, entropy = fn(h, w, targets, temperature)
    assert entropy.requires_grad
    ((logp * g_logp).sum() + (entropy * g_ent).sum()).backward()
    return h.grad, w.grad


@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_gradient_matches_float64(path, temperature):
    """entropy_grad=True: the gradient of H (-(1/T) q (log q + H) per logit) joins the log-prob's, on both
    paths; some rows carry only an entropy gradient (the tokens a high-entropy mask leaves out)."""
    n, h, v = 37, 48, 1000
    hidden, weight, targets = make(n, h, v, device=DEV if path == "triton" else "cpu")
    g_logp, g_ent = token_mean_grad(n), 0.3 * token_mean_grad(n + 1)[:n]
    g_logp[::3] = 0.0
    if path == "torch":
        fn = lambda h_, w_, t_, temp: logprobs_torch(h_, w_, t_, temp, chunk_elems=7 * v, entropy_grad=True)
    else:
        fn = lambda h_, w_, t_, temp: LogprobsFunction.apply(h_, w_, t_, temp, 20 * v, True)
    dev = hidden.device
    got = entropy_grads(fn, hidden, weight, targets, temperature, g_logp.to(dev), g_ent.to(dev))
    want = entropy_oracle(hidden, weight, targets, temperature, g_logp, g_ent)
    for name, a, b in zip(("grad hidden", "grad weight"), got, want):
        err = (a.double().cpu() - b).abs().max().item()
        assert err <= 1e-5, f"{name}: max abs error {err:.2e}"
    # the entropy's share is not negligible: without it the gradient is another one
    no_ent = entropy_oracle(hidden, weight, targets, temperature, g_logp, torch.zeros(n))
    assert (no_ent[0] - want[0]).abs().max() > 100 * 1e-5


def test_entropy_gradient_gradcheck():
    """The reference's analytic backward of (logp, entropy) in float64, against finite differences."""
    hidden, weight, targets = make(5, 6, 40, dtype=torch.float64)
    fn = lambda h_, w_: logprobs_torch(h_, w_, targets, 0.7, chunk_elems=2 * 40, entropy_grad=True)
    assert torch.autograd.gradcheck(fn, (hidden.requires_grad_(), weight.requires_grad_()))


@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=needs_triton)])
def test_without_entropy_grad_nothing_changes(path):
    """entropy_grad=False (the default) is the backward of before, bit for bit, whatever the entropy's use."""
    hidden, weight, targets = make(37, 48, 1000, device=DEV if path == "triton" else "cpu")
    g = token_mean_grad(37).to(hidden.device)
    with backend(path):
        a = run(lambda *x: token_logprobs(*x), hidden, weight, targets, 0.7, g)
        b = run(lambda *x: token_logprobs(*x, entropy_grad=False), hidden, weight, targets, 0.7, g)
        c = entropy_grads(lambda *x: token_logprobs(*x, entropy_grad=True), hidden, weight, targets, 0.7, g,
                          torch.zeros_like(g))  # fmt: skip
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    torch.testing.assert_close(c[0], a[2], rtol=0, atol=1e-7)  # a zero entropy gradient adds nothing


@needs_triton
def test_triton_vocab_splits_agree():
    """The forward's vocabulary split (partial LSEs combined outside) gives the same result for any split."""
    from nanogrpo_kernels.logprobs import _logprobs_fwd_triton

    hidden, weight, targets = make(24, 32, 1000, device=DEV)
    outs = [_logprobs_fwd_triton(hidden, weight, targets, 1.0, splits=s) for s in (1, 3, 8)]
    for o in outs[1:]:
        for a, b in zip(o, outs[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@needs_triton
def test_triton_bf16_accumulates_in_float32():
    hidden, weight, targets = make(32, 64, 1000, dtype=torch.bfloat16, device=DEV)
    with backend("triton"):
        logp, entropy = token_logprobs(hidden, weight, targets)
    # oracle on the same bf16-rounded inputs: only the accumulation differs
    want_logp, want_ent, _, _ = oracle(hidden, weight, targets, 1.0, torch.zeros(32))
    assert (logp.double().cpu() - want_logp).abs().max() < 1e-4
    assert (entropy.double().cpu() - want_ent).abs().max() < 1e-4


@needs_triton
@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_triton_grad_of_one_input_only(which):
    hidden, weight, targets = make(16, 32, 1000, device=DEV)
    h = hidden.clone().requires_grad_(which == "hidden")
    w = weight.clone().requires_grad_(which == "weight")
    with backend("triton"):
        logp, _ = token_logprobs(h, w, targets)
    logp.sum().backward()
    _, _, gh, gw = oracle(hidden, weight, targets, 1.0, torch.ones(16))
    got, want = (h.grad, gh) if which == "hidden" else (w.grad, gw)
    assert (h.grad is None) == (which != "hidden") and (w.grad is None) == (which != "weight")
    assert (got.double().cpu() - want).abs().max() < 1e-5


def test_gpu_tiles_follow_dtype_and_compute_capability():
    """GPU tiles come from the input width and the GPU generation (bench/kernels_aot.py compiles each for
    sm_80, sm_89 and sm_90): fp16 takes bf16's tiles, GPUs after sm_90 sm_90's, those before sm_80's."""
    for kernel in ("fwd", "bwd"):
        sm80, sm90 = GPU_CONFIGS[kernel, "16bit", "sm80"], GPU_CONFIGS[kernel, "16bit", "sm90"]
        assert gpu_config(kernel, torch.float16, (8, 9)) == gpu_config(kernel, torch.bfloat16, (8, 0)) == sm80
        assert (
            gpu_config(kernel, torch.bfloat16, (9, 0)) == gpu_config(kernel, torch.bfloat16, (12, 0)) == sm90
        )
        assert gpu_config(kernel, torch.float32, (7, 5)) == GPU_CONFIGS[kernel, "fp32", "sm80"]
    assert GPU_CONFIGS["fwd", "16bit", "sm80"] != GPU_CONFIGS["fwd", "16bit", "sm90"]  # sm_80 spills sm_90's
    cfg = gpu_config("fwd", torch.bfloat16, (9, 0))
    cfg["BLOCK_N"] = 1  # a copy: the caller may change it
    assert GPU_CONFIGS["fwd", "16bit", "sm90"]["BLOCK_N"] == 128


def test_dispatch_follows_backend_and_device():
    hidden, weight, targets = make(8, 16, 100)
    with backend("torch"):
        a = token_logprobs(hidden, weight, targets)
    want = oracle(hidden, weight, targets, 1.0, torch.zeros(8))
    torch.testing.assert_close(a[0].double(), want[0], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        nanogrpo_kernels.set_backend("cuda")
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, weight, targets, 0.0)


def test_backend_from_environment():
    code = "import nanogrpo_kernels; print(nanogrpo_kernels.get_backend())"
    env = dict(os.environ, NANOGRPO_KERNELS="torch")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch"
    env["NANOGRPO_KERNELS"] = "fast"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "NANOGRPO_KERNELS" in bad.stderr


class LargestAllocation(TorchDispatchMode):
    """Records the shape and size of every tensor an op allocates (views of its inputs excluded)."""

    def __init__(self):
        super().__init__()
        self.shapes, self.max_elems = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.shapes.append(tuple(t.shape))
                self.max_elems = max(self.max_elems, t.untyped_storage().nbytes() // t.element_size())
        return out


def peak_vocab_rows(fn, hidden, weight, targets):
    """Largest number of rows of any [rows, V] tensor, and the largest storage, in forward + backward."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with LargestAllocation() as mode:
        logp, _ = fn(h, w, targets)
        logp.sum().backward()
    v = weight.shape[0]
    rows = max((s[0] for s in mode.shapes if len(s) == 2 and s[1] == v), default=0)
    return rows, mode.max_elems


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_never_materialises_n_by_v(path):
    if path == "triton" and not TRITON_HERE:
        pytest.skip("Triton kernels cannot run in this process")
    n, h, v, chunk = 64, 32, 4097, 16  # N * V is twice the weight, so an [N, V] tensor would stand out
    hidden, weight, targets = make(n, h, v, device=DEV if path == "triton" else "cpu")
    if path == "torch":  # a batch one logit over the budget for keeping its log-softmax
        fn = lambda h_, w_, t_: logprobs_torch(h_, w_, t_, chunk_elems=chunk * v, keep_elems=n * v - 1)
    else:
        fn = lambda h_, w_, t_: LogprobsFunction.apply(h_, w_, t_, 1.0, chunk * v)
    rows, max_elems = peak_vocab_rows(fn, hidden, weight, targets)
    assert rows <= chunk, f"a [{rows}, V] tensor: more than one token chunk ({chunk} rows) of the vocabulary"
    assert max_elems <= max(chunk * v, v * h), f"an allocation of {max_elems} elements (N*V = {n * v})"
    # the same probe sees the naive path's [N, V] logits: the assertion above can fail
    naive = lambda h_, w_, t_: ((h_ @ w_.T).float().log_softmax(-1).gather(1, t_[:, None]).squeeze(1), None)
    assert peak_vocab_rows(naive, hidden, weight, targets)[0] == n


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_kept_log_softmax_gives_the_recomputed_gradient(entropy_grad):
    """A batch within keep_elems keeps its [N, V] log-softmax for the backward instead of recomputing the
    logits: the same gradients, bit for bit (twice, with retain_graph: the kept copy is read, not
    written), and nothing kept under no_grad or one logit over the budget."""
    n, h, v, chunk = 24, 16, 301, 7
    hidden, weight, targets = make(n, h, v)
    coef = torch.linspace(-1, 1, n)  # (N,) a gradient that differs per token

    def grads(keep):
        hd, wd = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = logprobs_torch(hd, wd, targets, 0.7, chunk * v, entropy_grad, keep_elems=keep)
        loss = (logp * coef).sum() + (0.3 * ent.sum() if entropy_grad else 0)
        first = torch.autograd.grad(loss, (hd, wd), retain_graph=True)
        return first, torch.autograd.grad(loss, (hd, wd))

    recomputed, kept = grads(0), grads(n * v)
    for a, b in zip(recomputed[0] + recomputed[1], kept[0] + kept[1]):
        assert torch.equal(a, b)
    fn = lambda h_, w_, t_: logprobs_torch(h_, w_, t_, 0.7, chunk * v, entropy_grad, keep_elems=n * v)
    assert peak_vocab_rows(fn, hidden, weight, targets)[0] == n  # the [N, V] copy: the probe sees it
    with LargestAllocation() as mode, torch.no_grad():
        fn(hidden.clone().requires_grad_(), weight.clone().requires_grad_(), targets)
    assert max(s[0] for s in mode.shapes if len(s) == 2 and s[1] == v) <= chunk


def test_policy_logprobs_match_naive_on_tiny_model(tiny_model_dir):
    """The trainer's log-probs and entropy equal the naive logits path on the tiny model."""
    from nanogrpo.model.fast.shared_prompt import FastLogprobHead
    from nanogrpo.model.logprobs import completion_logprobs
    from nanogrpo.model.transformer import Transformer
    from nanogrpo.rollout import make_batch

    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (4, 6), generator=g)
    completion = torch.randint(0, V, (4, 5), generator=g)
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    batch = make_batch(prompt, torch.ones_like(prompt), completion, mask)
    for name in ["torch"] + (["triton"] if TRITON_HERE and DEV == "cpu" else []):
        with backend(name):
            logp, entropy = completion_logprobs(FastLogprobHead(model), batch, temperature=0.8)
        logits = model(batch.ids, attention_mask=batch.attn, position_ids=batch.pos).double() / 0.8
        logsm = logits[:, 5:10].log_softmax(-1)  # positions 5..9 predict completion tokens 0..4
        want = logsm.gather(2, completion[:, :, None]).squeeze(2) * mask
        want_ent = -(logsm.exp() * logsm).sum(-1) * mask
        assert (logp.double() - want).abs().max() < 1e-5, name
        assert (entropy.double() - want_ent).abs().max() < 1e-5, name


@pytest.mark.skipif(
    DEV == "cuda" or TRITON_HERE or not nanogrpo_kernels.HAS_TRITON,
    reason="the Triton tests ran in this process",
)
def test_triton_in_interpreter_subprocess():
    """triton was imported before `nanogrpo_kernels` (interpreter off): run the Triton tests in a fresh
    process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-k", "triton", __file__],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-3000:]


def autocast_grads(fn, hidden, weight, grad_out, autocast: bool):
    """fn(h, w) -> logp, and the grads of sum(grad_out * logp) for float32 leaves h, w: the forward under CPU
    bf16 autocast when asked, the backward outside it (as the trainer runs them)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logp = fn(h, w)
    gh, gw = torch.autograd.grad((logp * grad_out).sum(), (h, w))
    return logp.detach(), gh, gw


def bf16_logits_oracle(hidden, weight, targets, temperature, grad_out):
    """float64 grads of the function a bf16 forward computes: logits of the bf16-rounded inputs, rounded to
    bf16 as a bf16 matmul's output is (for autograd the roundings are the identity, as casts are)."""
    h16, w16 = hidden.bfloat16(), weight.bfloat16()
    h, w = h16.double().requires_grad_(), w16.double().requires_grad_()
    z = h @ w.T  # (N, V)
    z = z + ((h16 @ w16.T).double() - z).detach()  # the bf16 values, the float64 derivative
    logp = (z / temperature).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    return torch.autograd.grad((logp * grad_out.double()).sum(), (h, w))


@pytest.mark.parametrize("n,h,v", SHAPES)
def test_reference_under_autocast_is_the_gradient_of_the_bf16_logits(n, h, v):
    """Full fine-tune: float32 weights, forward under bf16 autocast, backward outside it. The backward is the
    gradient of the bf16 logits the forward computed, not of float32 logits recomputed in the backward."""
    hidden, weight, targets = make(n, h, v)
    grad_out, temp = token_mean_grad(n), 0.7

    def explicit(dtype):  # what autocast's matmul does, written out: autograd through the casts
        def logp(h_, w_):
            z = (h_.to(dtype) @ w_.to(dtype).T).float() / temp  # (N, V)
            return z.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)

        return logp

    with backend("torch"):
        ours = lambda h_, w_: token_logprobs(h_, w_, targets, temp)[0]
        got = autocast_grads(ours, hidden, weight, grad_out, autocast=True)
    want = autocast_grads(explicit(torch.bfloat16), hidden, weight, grad_out, autocast=False)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    # grad hidden: (onehot - p) / T rounded to bf16, times the bf16 weight, as autograd does it
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5 * want[1].abs().max().item())
    # grad weight: accumulated in float32, returned in bf16 (the weight's dtype inside autocast), so
    # within one bf16 rounding of the exact gradient of the bf16 forward
    exact = bf16_logits_oracle(hidden, weight, targets, temp, grad_out)[1]
    one_rounding = 2.0**-8 * exact.abs() + 1e-5 * exact.abs().max()
    assert ((got[2].double() - exact).abs() <= one_rounding).all(), (got[2].double() - exact).abs().max()
    # the float32 gradient is another one: the checks above can fail
    fp32 = autocast_grads(explicit(torch.float32), hidden, weight, grad_out, autocast=False)
    assert (fp32[1] - want[1]).abs().max() > 100 * 1e-5 * want[1].abs().max()
    assert not ((fp32[2].double() - exact).abs() <= one_rounding).all()


@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=needs_triton)])
def test_autocast_equals_explicit_bf16_casts(path):
    """Both paths under bf16 autocast compute what they compute on inputs cast to bf16 by hand (float32
    accumulation on the Triton path), forward and backward, bit for bit."""
    hidden, weight, targets = make(37, 48, 1000)
    grad_out = token_mean_grad(37)
    ours = lambda h_, w_: token_logprobs(h_, w_, targets, 0.7)[0]
    cast = lambda h_, w_: token_logprobs(h_.bfloat16(), w_.bfloat16(), targets, 0.7)[0]
    with backend(path):
        got = autocast_grads(ours, hidden, weight, grad_out, autocast=True)
        want = autocast_grads(cast, hidden, weight, grad_out, autocast=False)
        fp32 = autocast_grads(ours, hidden, weight, grad_out, autocast=False)
    for a, b, c in zip(got, want, fp32):
        assert torch.equal(a, b)
        assert not torch.equal(a, c), "autocast had no effect"
