"""The fixed-shape decode loop (decode='static') against the eager one, and LoRA folded into the sampler.

Tokens must be equal with the same generators; log-probs agree to float32 rounding (the static loop's
masked softmax over every cache slot and its longer products round differently from the eager loop's
sliced ones), within LOGP_ATOL (tests/helpers.py).
"""

import collections
import copy
import functools
import os
import typing

import pytest
import torch
from helpers import MANY_EOS, assert_same
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanogrpo.config import SamplingConfig
from nanogrpo.infra import model_cache
from nanogrpo.model import lora
from nanogrpo.model.fast import kvcache, row_sampler, static_decode
from nanogrpo.model.fast.sampler import generate
from nanogrpo.model.fast.static_decode import DECODE_LOOPS, check_decode, check_rope
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import random_transformer, resolve_model

G, N_NEW = 3, 24


def sample(model, prompts, decode, **kw):
    """G completions per prompt, one generator per prompt (as rollout.py draws them)."""
    gens = [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]
    return generate(model, prompts, group_size=G, max_new_tokens=N_NEW, generator=gens, decode=decode, **kw)


def stops_from(model, tok, prompts) -> list[str]:
    """Stop strings the completions really produce, a few characters into two of them: the rows end at
    different steps, some inside a token."""
    plain = sample(model, prompts, "eager")
    texts = plain.texts(tok)
    return [texts[0][6:9], texts[4][12:14], "@@never"]


@pytest.mark.parametrize("case", ["plain", "eos", "stop", "greedy", "top_k"])
def test_static_decode_equals_eager(lively, case):
    model, tok, prompts = lively
    kw = {
        "plain": {},
        "eos": {"eos_ids": MANY_EOS},
        "stop": {"eos_ids": MANY_EOS[::4], "tokenizer": tok},
        "greedy": {"temperature": 0.0, "eos_ids": MANY_EOS[::3]},
        "top_k": {"temperature": 0.8, "top_k": 20, "eos_ids": MANY_EOS},
    }[case]
    if case == "stop":
        kw["stop_strings"] = stops_from(model, tok, prompts)
    eager, static = sample(model, prompts, "eager", **kw), sample(model, prompts, "static", **kw)
    assert_same(eager, static)
    lengths = eager.lengths.tolist()
    if case in ("eos", "stop"):
        assert len(set(lengths)) > 3 and max(lengths) > 8, lengths  # past a host sync, ending apart
    if case == "stop":
        assert static.texts(tok, kw["stop_strings"]) == eager.texts(tok, kw["stop_strings"])
        assert sum(not t for t in static.truncated.tolist()) > 2


def test_static_decode_equals_eager_in_bf16(lively):
    """A bf16 model (on the CPU: bf16 weights, a float32 cache the new keys are cast into)."""
    model, _, prompts = lively
    bf16 = Transformer.from_pretrained(resolve_model("tiny"), dtype=torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    kw = {"eos_ids": MANY_EOS}
    assert_same(sample(bf16, prompts, "eager", **kw), sample(bf16, prompts, "static", **kw))


@pytest.fixture(scope="module")
def with_lora(lively):
    """The lively model with LoRA (r 4, random B) on every projection, as a training run samples it."""
    model = Transformer.from_pretrained(resolve_model("tiny"))
    model.load_state_dict(lively[0].state_dict())
    lora.inject_lora(model, r=4, alpha=8.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return model


def test_static_decode_with_lora(lively, with_lora, monkeypatch):
    """LoRA injected (random B): static equals eager, with packed weights (the CPU's default) and without
    (NANOGRPO_PACKED=0: the folded plain weights)."""
    model, prompts = with_lora, lively[2]
    kw = {"eos_ids": MANY_EOS}
    assert_same(sample(model, prompts, "eager", **kw), sample(model, prompts, "static", **kw))
    monkeypatch.setenv("NANOGRPO_PACKED", "0")
    assert_same(sample(model, prompts, "eager", **kw), sample(model, prompts, "static", **kw))


def test_folded_lora_samples_as_the_adapters(lively, monkeypatch):
    """Without packing, W + (alpha / r) B A folded into one weight samples the same tokens as the adapters
    run separately (log-probs to float32 rounding), and the trained weights are untouched afterwards."""
    monkeypatch.setenv("NANOGRPO_PACKED", "0")
    _, _, prompts = lively
    model = Transformer.from_pretrained(resolve_model("tiny"))
    model.load_state_dict(lively[0].state_dict())
    lora.inject_lora(model, r=4, alpha=8.0, targets=("q_proj", "v_proj", "gate_proj", "down_proj"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kw = {"eos_ids": MANY_EOS}
    folded = sample(model, prompts, "eager", **kw)
    adapters = sample(model, prompts, "eager", fold_lora=False, **kw)
    assert_same(adapters, folded)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert len(lora.lora_modules(model)) == 4 * model.config.num_hidden_layers  # the adapters are back


VIEWS = {"view", "reshape", "_reshape_alias", "_unsafe_view", "transpose", "permute", "select", "slice"}
VIEWS |= {"expand", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "narrow", "as_strided"}
VIEWS |= {"to", "detach", "alias", "t", "is_nonzero", "item", "_local_scalar_dense"}
MATMULS = {"mm", "bmm", "baddbmm", "addmm", "linear", "matmul", "_linear_pointwise", "_mkl_linear"}


def ops_per_step(model, decode: str) -> collections.Counter:
    """Top-level ATen ops (not the ones they call) of one decode step, by the difference of two calls."""
    from torch.profiler import ProfilerActivity, profile

    def top_level(e) -> bool:
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        return p is None

    def count(n: int) -> collections.Counter:
        gens = [torch.Generator().manual_seed(0)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(model, [[5, 6, 7, 8]], group_size=2, max_new_tokens=n, generator=gens, decode=decode)
        return collections.Counter(
            e.name.removeprefix("aten::")
            for e in prof.events()
            if e.name.startswith("aten::") and top_level(e)
        )

    n = 5  # no host sync of the static loop in these steps
    many, one = count(n), count(1)
    return collections.Counter({k: (many[k] - one[k]) / (n - 1) for k in many if many[k] != one[k]})


def test_static_decode_step_dispatches_fewer_ops():
    """Host-side ops per decode step on a tiny-width, 28-layer Qwen2-shaped model: the static step has
    fewer (it is not the compiled one yet: the counts are printed)."""
    spec = "qwen2.5-1.5b:layers=28,hidden_size=64,intermediate_size=128,num_attention_heads=4,vocab_size=512"
    model = random_transformer(spec, dtype=torch.float32)
    totals = {}
    for decode in ("eager", "static"):
        ops = ops_per_step(model, decode)
        compute = sum(v for k, v in ops.items() if k not in VIEWS and k not in MATMULS)
        totals[decode] = sum(ops.values())
        print(f"{decode}: {totals[decode]:.0f} ATen ops per step, {compute:.0f} of them not views or matmuls")
    assert totals["static"] < totals["eager"]


@pytest.mark.parametrize("case", ["eos", "stop"])
def test_graph_loop_equals_eager(lively, with_lora, case):
    """decode='graph' off CUDA: CapturedStep runs the closure a CUDA graph records, once per step (the first
    call as the warm-up step, then as the replays): the same tokens as the eager sampler, with LoRA."""
    _, tok, prompts = lively
    kw = {"eos_ids": MANY_EOS}
    if case == "stop":
        kw = {"eos_ids": MANY_EOS[::4], "tokenizer": tok, "stop_strings": stops_from(with_lora, tok, prompts)}
    eager, graph = sample(with_lora, prompts, "eager", **kw), sample(with_lora, prompts, "graph", **kw)
    assert_same(eager, graph)
    assert len(set(eager.lengths.tolist())) > 3  # rows end apart, some after a host sync


def test_visible_keys_double_up_to_the_buffer():
    assert [kvcache.visible_keys(m, 1024) for m in (1, 64, 65, 128, 129, 600, 1023)] == [
        64, 64, 128, 128, 256, 1024, 1024,
    ]  # fmt: skip
    assert kvcache.visible_keys(300, 256) == 256 and kvcache.visible_keys(5, 24) == 24


@pytest.mark.parametrize("decode", ["static", "graph"])
@pytest.mark.parametrize("case", ["plain", "stop"])
def test_steps_read_more_keys_as_they_go(lively, monkeypatch, decode, case):
    """The own keys a step reads grow with the step (visible_keys; here 4, 8, 16, then 24 of 24): the same
    tokens as the eager sampler through every change, and the graph loop records once for each value."""
    model, tok, prompts = lively
    monkeypatch.setattr(kvcache, "MIN_VISIBLE", 4)
    recordings = []
    real = static_decode.CapturedStep
    monkeypatch.setattr(static_decode, "CapturedStep", lambda *a: recordings.append(a) or real(*a))
    kw = {}
    if case == "stop":
        kw = {"eos_ids": MANY_EOS[::4], "tokenizer": tok, "stop_strings": stops_from(model, tok, prompts)}
    assert_same(sample(model, prompts, "eager", **kw), sample(model, prompts, decode, **kw))
    if case == "plain":  # every row runs to N_NEW = 24 tokens
        assert len(recordings) == (4 if decode == "graph" else 0)


SYNCS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal", "masked_select", "allclose"}
SYNCS |= {"_unique2", "unique_consecutive", "unique_dim", "repeat_interleave"}  # host-sized outputs
SYNCS |= {
    "isin"
}  # one op here, but on CUDA, for more rows than ~10 x E^0.145 for E ids, a sort and a unique()


class Recording(TorchDispatchMode):
    """Every op one call dispatches, as a CUDA graph would record it: its name, its tensors' shapes and
    dtypes and its other arguments; and the tensors it reads that the call did not make itself (what a
    graph replays by address: they must be the same tensors every step)."""

    def __init__(self):
        super().__init__()
        self.ops, self.made, self.read = [], set(), set()

    @staticmethod
    def key(t: torch.Tensor):
        return t.untyped_storage().data_ptr() if t.layout == torch.strided else id(t)  # packed: opaque

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        for a in flat:
            if isinstance(a, torch.Tensor) and self.key(a) not in self.made:
                self.read.add(self.key(a))
        out = func(*args, **kwargs)
        self.made |= {self.key(o) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)}
        shown = [(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in flat]
        self.ops.append((func.__name__, tuple(shown)))
        return out


@pytest.mark.parametrize("packed", ["1", "0"])
def test_decode_step_is_one_recording(lively, with_lora, monkeypatch, packed):
    """What lets `--sampling.decode graph` replay a CUDA graph, shown on the CPU: two consecutive decode steps
    (LoRA, EOS ids, stop strings) dispatch the same ops with the same shapes and the same Python arguments,
    read the same tensors from outside the step (no new tensor, no value that changes), and never ask the
    host for a value (no .item(), no nonzero). NANOGRPO_PACKED=0 runs the weights as a GPU has them: folded,
    not packed."""
    monkeypatch.setenv("NANOGRPO_PACKED", packed)
    _, tok, prompts = lively
    recordings, calls = [], []
    step = row_sampler.decode_step

    def recorded(*a, **kw):
        calls.append(1)
        if len(calls) in (3, 4):  # steps 3 and 4: past the first, between two host syncs
            with Recording() as r:
                step(*a, **kw)
            recordings.append(r)
        else:
            step(*a, **kw)

    monkeypatch.setattr(row_sampler, "decode_step", recorded)
    stops = stops_from(with_lora, tok, prompts)
    sample(with_lora, prompts, "graph", eos_ids=MANY_EOS, tokenizer=tok, stop_strings=stops)
    first, second = recordings
    print(
        f"NANOGRPO_PACKED={packed}: {len(first.ops)} ops a step, {len(first.read)} tensors read from outside"
    )
    assert len(first.ops) > 50 and first.ops == second.ops
    assert first.read == second.read
    assert not {name.split(".")[0] for name, _ in first.ops} & SYNCS


def test_graph_loops_need_cuda_and_no_fsdp():
    """The refusal before the model loads, and the config's choices are the sampler's."""
    assert typing.get_args(typing.get_type_hints(SamplingConfig)["decode"]) == DECODE_LOOPS
    for decode in ("graph", "compiled-graph"):
        with pytest.raises(
            ValueError, match="CUDA graph, and this run is on cpu: use --sampling.decode compiled"
        ):
            check_decode(decode, torch.device("cpu"), "none")
        with pytest.raises(ValueError, match="--model.parallel ddp"):
            check_decode(decode, torch.device("cuda"), "fsdp")
        check_decode(decode, torch.device("cuda"), "ddp")
    for decode in ("eager", "static", "compiled"):
        check_decode(decode, torch.device("cpu"), "fsdp", "tiny")
    # a traced step cannot follow RoPE tables that change with the length (Phi-3's longrope, dynamic NTK)
    for decode in ("compiled", "graph", "compiled-graph"):
        with pytest.raises(ValueError, match=r"RoPE \(longrope\) depends on the sequence length"):
            check_rope(decode, {"rope_type": "longrope", "factor": 4.0})
        check_rope(decode, {"rope_type": "llama3"})
    check_rope("static", {"rope_type": "dynamic"})


def test_train_refuses_a_graph_loop_on_the_cpu_before_the_model_loads(tmp_path):
    from helpers import run_train_here

    run = ("tiny", "--out-dir", str(tmp_path / "run"), "--model.device", "cpu")  # cpu: also on a GPU machine
    r = run_train_here(*run, "--sampling.decode", "graph")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--sampling.decode graph replays the decode step as a CUDA graph" in r.stderr.splitlines()[-1]
    assert not (tmp_path / "run" / "config.json").exists()


class Devices(TorchDispatchMode):
    """The devices of every tensor an op is given."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = tree_flatten((args, kwargs or {}))[0]
        self.seen |= {a.device.type for a in flat if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))


def test_graph_loop_runs_on_a_stand_in_device(monkeypatch):
    """The graph loop's steps on the meta device, a stand-in for CUDA (shapes, no data): a step that read a
    value back to the host would raise there, and every tensor the recorded steps' ops take is on the model's
    device (a CPU tensor in a CUDA graph is a copy the graph cannot replay). LoRA folded into the weights, as
    on a GPU."""
    from nanogrpo.model.fast.grouped import StaticGroupedKVCache, prefill_grouped
    from nanogrpo.model.fast.packed import folded_lora
    from nanogrpo.model.sampling import sample_tokens

    spec = "qwen2.5-1.5b:layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,vocab_size=1024"
    cpu = random_transformer(spec, dtype=torch.float32)
    lora.inject_lora(cpu, r=4, alpha=8.0)
    meta = torch.device("meta")
    G, max_new = 2, 6  # under SYNC_EVERY: no host sync in the loop, which meta could not answer
    cache_cls = functools.partial(StaticGroupedKVCache, bucket=1)
    W = cpu.lm_head_weight
    logits, cache, next_pos = prefill_grouped(
        cpu, lambda h: h @ W.T, [[5, 6, 7], [8, 9]], G, max_new, 0, None, cache_cls
    )
    cache.next_pos = next_pos
    for name, v in vars(cache).items():  # the prompts' cache, as a GPU's prefill leaves it
        if isinstance(v, torch.Tensor) or (isinstance(v, list) and v and isinstance(v[0], torch.Tensor)):
            setattr(cache, name, v.to(meta) if isinstance(v, torch.Tensor) else [x.to(meta) for x in v])
    model = cpu.to(meta)
    seen, steps, step = set(), [], row_sampler.decode_step

    def watched(*a, **kw):
        steps.append(1)
        if len(steps) == 1:  # the warm-up step, run before the recording (it builds RoPE's table here)
            return step(*a, **kw)
        with Devices() as d:  # the steps a graph replays
            step(*a, **kw)
        seen.update(d.seen)

    monkeypatch.setattr(row_sampler, "decode_step", watched)
    sample = lambda lg, u: sample_tokens(lg, 1.0, 1.0, 0, None, u)  # noqa: E731
    with folded_lora(model, enabled=True):
        W = model.lm_head_weight
        s = row_sampler.decode_loop(
            model, lambda h: h @ W.T, cache, logits.to(meta), max_new, sample, [3, 4], (), None, None, 2, G, 0,
            1.0, "graph",
        )  # fmt: skip
    assert len(steps) == max_new - 1 and seen == {"meta"}
    assert s.tokens.device == meta and s.tokens.shape == (2 * G, max_new)


def test_compiled_kernels_go_to_a_folder_of_the_users_own(tmp_path, monkeypatch):
    """Inductor's default cache is a /tmp folder another user can make first (and fill with kernels this
    process would load): the compiled step compiles into nanogrpo's cache folder instead, one per CPU code
    path, made private; a folder another user may write is refused; TORCHINDUCTOR_CACHE_DIR, when set, wins."""
    monkeypatch.setenv("NANOGRPO_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    model_cache.private_inductor_cache()
    folder = tmp_path / "inductor-avx2"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder) and folder.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/chosen")
    model_cache.private_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/chosen"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor writes when it looks
    model_cache.private_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    shared = tmp_path / "inductor-default"
    shared.mkdir()
    shared.chmod(0o777)  # as a folder someone else made for everyone would be
    with pytest.raises(RuntimeError, match="another user owns it or may write to it .mode 777.: remove it"):
        model_cache.private_inductor_cache()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_train_refuses_a_compiled_step_for_a_length_dependent_rope(tmp_path):
    """check_decode reads the model's config.json at start-up (no weights needed yet): Phi-3's longrope."""
    import json

    cfg = json.loads((resolve_model("tiny") / "config.json").read_text())
    long = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
    }
    cfg["rope_parameters"] = long  # transformers >= 5 (the tiny model's); older configs say rope_scaling
    cfg["original_max_position_embeddings"] = 256
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"RoPE \(longrope\) depends on the sequence length"):
        check_decode("compiled", torch.device("cpu"), "none", str(tmp_path))
    check_decode("static", torch.device("cpu"), "none", str(tmp_path))  # the static loop reads it per step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: bench/gpu_check.sh runs it there")
@pytest.mark.parametrize("decode", ["static", "graph", "compiled-graph"])
def test_cuda_decode_loops_equal_eager(lively, with_lora, decode):
    """On a GPU: the fixed-shape loop, the step replayed as a CUDA graph, and the compiled step replayed give
    the eager sampler's tokens (LoRA folded, per-prompt CUDA generators, EOS ids and stop strings)."""
    _, tok, prompts = lively
    stops = stops_from(with_lora, tok, prompts)
    model = copy.deepcopy(with_lora).cuda()
    kw = {"group_size": G, "max_new_tokens": N_NEW, "eos_ids": MANY_EOS[::4], "tokenizer": tok}
    gens = lambda: [torch.Generator("cuda").manual_seed(100 + i) for i in range(len(prompts))]  # noqa: E731
    eager = generate(model, prompts, generator=gens(), decode="eager", stop_strings=stops, **kw)
    other = generate(model, prompts, generator=gens(), decode=decode, stop_strings=stops, **kw)
    assert_same(eager, other, atol=1e-4)  # cuBLAS picks other kernels for other shapes: 1e-4, not 1e-5
    assert len(set(eager.lengths.tolist())) > 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: bench/gpu_check.sh runs it there")
def test_cuda_graph_under_autocast_replays_the_static_step(lively):
    """A full fine-tune samples its float32 weights under bf16 autocast, whose cache holds each weight's bf16
    copy for the call. The recording reads those copies (made by the prefill and the step that runs before
    it); replaying it after they were freed would read garbage. The replayed loop must give the static
    loop's tokens: the same kernels on the same inputs."""
    model, tok, prompts = lively
    model = copy.deepcopy(model).cuda()  # float32 parameters that require grad: autocast caches their casts
    assert all(p.requires_grad for p in model.parameters())
    kw = {"group_size": G, "max_new_tokens": N_NEW, "eos_ids": MANY_EOS[::4], "autocast": torch.bfloat16}
    gens = lambda: [torch.Generator("cuda").manual_seed(100 + i) for i in range(len(prompts))]  # noqa: E731
    static = generate(model, prompts, generator=gens(), decode="static", **kw)
    graph = generate(model, prompts, generator=gens(), decode="graph", **kw)
    again = generate(model, prompts, generator=gens(), decode="graph", **kw)  # a new recording per call
    assert_same(static, graph, atol=1e-4)
    assert_same(graph, again, atol=0.0)
    assert len(set(static.lengths.tolist())) > 1


class FakeCuda:
    """Stands in for torch.cuda's streams, stream contexts and graphs, to drive CapturedStep's CUDA branch."""

    replays = 0

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def replay(self):
        FakeCuda.replays += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_captured_step_runs_once_records_once_then_replays(monkeypatch):
    """CapturedStep on CUDA (its streams and graph faked): the first call runs the step on a side stream and
    records it; every later call only replays. A recording that fails says what to run instead."""
    FakeCuda.replays = 0
    monkeypatch.setattr(torch.cuda, "Stream", FakeCuda)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeCuda())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: FakeCuda())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCuda)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: FakeCuda())
    runs = []
    step = static_decode.CapturedStep(lambda: runs.append(1), torch.device("cuda"))
    step()
    assert len(runs) == 2 and FakeCuda.replays == 0  # the step for real, then under the (fake) recording
    step(), step()
    assert len(runs) == 2 and FakeCuda.replays == 2

    class Refused(FakeCuda):
        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: Refused())
    with pytest.raises(RuntimeError, match="not permitted .*\nSample with --sampling.decode static"):
        static_decode.CapturedStep(lambda: None, torch.device("cuda"))()
