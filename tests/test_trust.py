"""What the trainer's numbers can be trusted for: an exact KL at the reference, importance-sampling
corrections with the right expectation, the top-k/top-p bias that GRPO refuses, and torchrun's collectives."""

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nanogrpo.config import GRPOConfig
from nanogrpo.grpo import grpo_loss, importance_weights
from nanogrpo.infra import dist
from nanogrpo.infra.flag_checks import check_config
from nanogrpo.lab.toy import TabularPolicy
from nanogrpo.recipes.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
PRESET = replace(PRESETS["tiny"][1], plots=False)  # no PNGs or run page: nothing here reads them


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- KL at the reference


@pytest.mark.parametrize("placement", ["loss", "reward"])
@pytest.mark.parametrize("model", ["lora", "full-fp32", "full-bf16"])
def test_a_policy_equal_to_its_reference_has_a_kl_of_exactly_zero(tmp_path, model, placement):
    """Step 1: the policy is its reference, so every KL is exactly 0 (not sampler-vs-trainer rounding noise),
    and a group whose task rewards tie stays a zero-spread group with a KL in the reward."""
    from train import main

    lora = replace(PRESET.lora, r=0) if model.startswith("full") else PRESET.lora
    dtype = "bfloat16" if model == "full-bf16" else "float32"
    cfg = replace(
        PRESET,
        out_dir=str(tmp_path),
        steps=1,
        prompts_per_step=4,
        lora=lora,
        model=replace(PRESET.model, dtype=dtype),
        grpo=replace(PRESET.grpo, kl_placement=placement, beta=0.5),
        # a random model's words never match the references: the task rewards of most groups tie at 0
        reward=replace(PRESET.reward, spec="rouge_l:1"),
    )
    main(cfg)
    m = metrics(tmp_path)[0]
    assert m["kl"] == 0.0
    groups = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()][0]["groups"]
    tied = [len({c["reward"] for c in g["completions"]}) == 1 for g in groups]
    assert any(tied)  # else the check below could not fail
    assert m["frac_zero_std"] == sum(tied) / len(tied)
    if placement == "reward":
        assert m["kl_reward"] == 0.0
        assert all(c["advantage"] == 0.0 for g, t in zip(groups, tied) if t for c in g["completions"])


def test_the_sampler_trainer_gap_is_logged_every_step(tmp_path):
    from train import main

    main(replace(PRESET, out_dir=str(tmp_path), steps=2, grpo=replace(PRESET.grpo, is_correction="tis")))
    for m in metrics(tmp_path):
        assert 0 <= m["sampler_abs_diff"] < 1e-3  # float32 sampler and trainer: rounding, not a bug
        assert 0 <= m["sampler_kl"] < 1e-6 and m["sampler_ratio_max"] > 0 and m["is_capped"] == 0.0


# ----------------------------------------------------------------------------- IS corrections, exactly


def _expected_pg_grad(pol, theta, theta_s, adv, cfg):
    """E_{y ~ mu}[grad of the on-policy GRPO loss] with mu = pi(theta_s) the sampler and pi(theta) the trainer,
    through grpo_loss itself (each sequence's gradient weighted by mu(y)), as a gradient of -E[A]."""
    T = pol.T
    theta = theta.detach().requires_grad_(True)
    mu = pol.seq_logp(theta_s).exp().detach()  # (S,)
    logp = pol.token_logp(theta)  # (S, T)
    sampler = pol.token_logp(theta_s).detach()  # (S, T)
    S = logp.shape[0]
    mask = torch.ones_like(logp)
    scale = (mu * S * T)[:, None]  # token-mean divides by S * T
    logp_w = logp.detach() + (logp - logp.detach()) * scale
    loss, _ = grpo_loss(
        logp_w,
        logp.detach(),
        None,
        adv,
        mask,
        cfg,
        num_seqs=S,
        num_tokens=S * T,
        max_len=T,
        sampler_logp=sampler,
    )
    return torch.autograd.grad(loss, theta)[0]


def _setup(noise=0.3, seed=0, T=3):
    pol = TabularPolicy(V=3, T=T)
    g = torch.Generator().manual_seed(seed)
    theta = pol.init(1.0, g)
    theta_s = theta + noise * torch.randn(theta.shape, generator=g, dtype=theta.dtype)
    adv = torch.randn(pol.n_seq, generator=g, dtype=theta.dtype)  # a fixed advantage per sequence
    th = theta.detach().requires_grad_(True)
    true = -torch.autograd.grad((pol.seq_logp(th).exp() * adv).sum(), th)[0]  # grad of -E_pi[A]
    return pol, theta, theta_s, adv, true


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_importance_corrections_have_the_expected_gradient_when_sampler_and_trainer_differ():
    pol, theta, theta_s, adv, true = _setup()
    c = GRPOConfig(loss_agg="token-mean")
    grad = lambda **kw: _expected_pg_grad(pol, theta, theta_s, adv, replace(c, **kw))  # noqa: E731
    none = grad(is_correction="none")
    assert _rel(none, true) > 0.1  # sampling from mu and ignoring it is biased
    # one weight per sequence, uncapped: E_mu[(pi/mu) A grad log pi] = E_pi[A grad log pi], exactly
    seq = grad(is_correction="tis", is_level="sequence", is_cap=1e9)
    assert _rel(seq, true) < 1e-12
    assert _rel(grad(is_correction="mis", is_level="sequence", is_cap=1e9), true) < 1e-12
    # per token: each token's own draw is corrected, the contexts stay mu's; with a sequence's advantage
    # that leaves a bias (exact for one-token completions, below)
    tok = grad(is_correction="tis", is_level="token", is_cap=1e9)
    assert _rel(tok, true) > 1e-3
    pol1, theta1, theta1_s, adv1, true1 = _setup(T=1)
    for level in ("token", "sequence"):
        g1 = _expected_pg_grad(
            pol1, theta1, theta1_s, adv1, replace(c, is_correction="tis", is_level=level, is_cap=1e9)
        )
        assert _rel(g1, true1) < 1e-12, level

    # capped: exactly the truncated / masked expectations, by enumeration
    th = theta.detach().requires_grad_(True)
    logq = pol.seq_logp(th)  # (S,)
    w = (logq - pol.seq_logp(theta_s)).detach().exp()  # (S,) pi / mu per sequence
    mu = pol.seq_logp(theta_s).exp()
    v = torch.maximum(w, 1 / w).sort().values
    C = float(
        v[len(v) // 2 : len(v) // 2 + 2].mean()
    )  # half the sequences outside [1/C, C], none on its edge
    for mode, weight in (("tis", w.clamp(max=C)), ("mis", torch.where((w >= 1 / C) & (w <= C), w, 0.0))):
        want = -torch.autograd.grad((mu * weight * adv * logq).sum(), th, retain_graph=True)[0]
        got = grad(is_correction=mode, is_level="sequence", is_cap=C)
        assert _rel(got, want) < 1e-12, mode
        assert _rel(got, true) > 1e-3  # the cap is a bias, and it is visible


def test_importance_weights_are_one_when_the_sampler_is_the_trainer():
    old = -torch.rand(4, 5, dtype=torch.float64)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 4])[:, None]).double()
    for mode in ("none", "tis", "mis"):
        for level in ("token", "sequence"):
            w, stats = importance_weights(old, old, mask, GRPOConfig(is_correction=mode, is_level=level))
            assert torch.equal(w, mask)
            assert stats["sampler_abs_diff"] == 0 and stats["sampler_kl"] == 0 and stats["is_capped"] == 0
            assert stats["sampler_ratio_max"] == 1.0


# ----------------------------------------------------------------------------- top-k / top-p: refused


def test_top_k_sampling_biases_the_policy_gradient_and_grpo_refuses_it():
    """One token from 3 with top-k 2: samples come from q (pi cut to its 2 best tokens, renormalised), but the
    ratio, the KL and the entropy see pi. The expected gradient of the trainer's loss is then
    E_q[A grad log pi] instead of grad E_pi[A]: 20%+ off here, so GRPO refuses top-k/top-p at start-up."""
    theta = torch.tensor([1.0, 0.6, -0.2], dtype=torch.float64, requires_grad=True)
    A = torch.tensor([1.0, -0.5, 0.8], dtype=torch.float64)  # a fixed advantage per token
    logp = torch.log_softmax(theta, 0)  # (3,)
    p = logp.exp().detach()
    true = torch.autograd.grad((logp.exp() * A).sum(), theta, retain_graph=True)[0]
    for q in (p, torch.tensor([p[0], p[1], 0.0], dtype=torch.float64) / (p[0] + p[1])):
        got = torch.autograd.grad((q * A * logp).sum(), theta, retain_graph=True)[0]  # E_q[A grad log pi]
        err = _rel(got, true)
        assert err < 1e-12 if q is p else err > 0.2
    for flags in ({"top_k": 2}, {"top_p": 0.9}):
        with pytest.raises(ValueError, match="truncated distribution"):
            check_config(replace(PRESET, sampling=replace(PRESET.sampling, **flags)))


@pytest.mark.parametrize(
    "section, flags, needle",
    [
        ("sampling", {"temperature": 0.0}, "temperature 0.0"),
        ("grpo", {"kl_placement": "loss", "beta": 0.0}, "--grpo.beta 0"),
        ("grpo", {"is_correction": "tis", "is_cap": 1.0}, "is-cap"),
    ],
)
def test_start_up_checks(section, flags, needle):
    cfg = replace(PRESET, **{section: replace(getattr(PRESET, section), **flags)})
    with pytest.raises(ValueError, match=needle):
        check_config(cfg)
    check_config(replace(cfg, algo="sft"))  # SFT samples nothing


# ----------------------------------------------------------------------------- torchrun's collectives


def test_a_gpu_run_reduces_cpu_tensors_through_gloo(monkeypatch):
    """NCCL has no CPU all_reduce: a CUDA run's group has gloo for the CPU counts and metrics."""
    assert dist.backend_for("cuda") == "cpu:gloo,cuda:nccl" and dist.backend_for("cpu") == "gloo"
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_distributed", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("device", i))
    monkeypatch.setattr(dist.dist, "init_process_group", lambda **kw: seen.update(kw))
    dist.init("cuda")
    assert seen["backend"] == "cpu:gloo,cuda:nccl" and seen["device"] == 0


COLLECTIVES = """
import os, sys
import torch, torch.distributed as tdist
from pathlib import Path
from nanogrpo.infra import dist
from nanogrpo.policy import Policy

tdist.init_process_group("cpu:gloo")  # a CUDA run's group, less NCCL (not built into CPU torch)
r = dist.rank()
sys.stdout = open(os.path.join(os.environ["OUT"], f"rank{r}.txt"), "w")  # the ranks' lines apart
assert dist.sum_floats({"a": 1.0 + r, "b": 2.0}) == {"a": 3.0, "b": 4.0}
assert dist.max_floats({"a": 1.0 + r}) == {"a": 2.0}
try:
    dist.sum_floats({"a": 1.0, **({"digit_mass": 0.5} if r == 0 else {})})
    print("NO ERROR")
except AssertionError as e:
    print("KEYS", "metric keys differ" in str(e))

# DDP: one all-reduce per pass, with the last micro-batch, and the gradient of the whole pass
torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
ddp = torch.nn.parallel.DistributedDataParallel(net)
calls = []
def hook(state, bucket):
    calls.append(1)
    fut = torch.futures.Future()
    t = bucket.buffer()
    tdist.all_reduce(t)
    fut.set_result(t)
    return fut
ddp.register_comm_hook(None, hook)
policy = Policy(ddp, None, None, 0, [], None, False, Path("."))
x = torch.arange(24.0).view(6, 4) + r
for k in range(3):
    with policy.no_sync(last=k == 2):
        ddp(x[2 * k : 2 * k + 2]).sum().backward()
print("CALLS", len(calls), net.weight.grad.tolist())
sys.stdout.close()
tdist.barrier()
os._exit(0)  # skip gloo's teardown: it aborts now and then at exit on a loaded machine, after all the work
"""


def test_collectives_check_keys_and_ddp_syncs_once_per_pass(tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
    ]
    cmd += ["--master-port", str(port), str(script)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OUT": str(tmp_path)}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # rank r's rows are arange + r: the summed gradient is the column sums of both ranks' inputs
    want = (torch.arange(24.0).view(6, 4).sum(0) * 2 + 6).tolist()
    for rank in (0, 1):
        out = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert out == ["KEYS True", f"CALLS 1 {[want]}"], out
