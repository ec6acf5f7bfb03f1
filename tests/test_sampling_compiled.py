"""The compiled decode step (decode='compiled': static_decode.decode_step through torch.compile) on a
tiny-width, 28-layer Qwen2 shape with LoRA injected as training runs it: the same tokens as the eager
sampler, one compiled graph for prompts of other lengths, and the host-side ops of a decode step counted.

Log-probs agree within LOGP_ATOL: 28 layers of float32 rounding (the fused kernels sum in another order than
the eager ops; 9e-6 at most measured here), where the static tests' 2-layer model stays within 1e-5.

One model and one compile (about a minute and a half on a 2-core CPU, once for the module): every test
samples the same batch shape, EOS ids and sampling settings, so the graph compiled first serves them all.
"""

import collections
import os

import pytest
import torch
from helpers import MANY_EOS, TEXTS, assert_same, check_continuation
from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

from nanogrpo.infra.cpu import cpu_capability
from nanogrpo.model import lora
from nanogrpo.model.fast import kvcache
from nanogrpo.model.fast.sampler import generate
from nanogrpo.model.fast.static_decode import PROMPT_BUCKET
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import load_tokenizer, random_transformer, resolve_model

pytestmark = pytest.mark.slow
CHOSEN = os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) != default_cache_dir()  # by the user
SHAPE = "qwen2.5-1.5b:layers=28,hidden_size=64,intermediate_size=128,num_attention_heads=4,vocab_size=1024"
G, N_NEW = 3, 24
LOGP_ATOL = 3e-5
LOGP_ATOL_BF16 = 2e-4  # a bf16 model: 6e-5 measured, far under bf16's own rounding (4e-3 relative)
MATMULS = {"mm", "bmm", "baddbmm", "addmm", "linear", "matmul", "_linear_pointwise", "_mkl_linear"}
MATMULS |= {"onednn_linear", "mkl_linear"}  # packed.py's custom ops around the packed matmuls
DISPATCHED = ("aten::", "mkldnn::", "mkl::", "nanogrpo::")  # ops the host dispatches


@pytest.fixture(scope="module")
def lora_model():
    """The 28-layer shape in float32 with weights large enough that its samples vary, and LoRA (r 4, random
    B) on every projection; the tiny model's tokenizer (same vocabulary) for the prompts and stop strings."""
    model = random_transformer(SHAPE, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in model.parameters():
            if w.ndim == 2:
                w.normal_(0, 0.15, generator=g)
    lora.inject_lora(model, r=4, alpha=8.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=g)
    tok = load_tokenizer(resolve_model("tiny"))
    return model, tok, [tok.encode(t) for t in TEXTS]


def sample(model, prompts, decode, **kw):
    """G completions per prompt, one generator per prompt (as rollout.py draws them), EOS ids that end rows
    at different steps."""
    gens = [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]
    return generate(
        model, prompts, group_size=G, max_new_tokens=N_NEW, generator=gens, decode=decode, eos_ids=MANY_EOS,
        **kw,
    )  # fmt: skip


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("case", ["eos", "stop"])
def test_compiled_decode_equals_eager(lora_model, case):
    model, tok, prompts = lora_model
    kw = {}
    if case == "stop":
        texts = [t for t in sample(model, prompts, "eager").texts(tok) if len(t) >= 14]
        assert len(texts) >= 2, texts  # stop strings the completions really produce, some inside a token
        kw = {"tokenizer": tok, "stop_strings": [texts[0][6:9], texts[1][12:14], "@@never"]}
    eager, compiled = sample(model, prompts, "eager", **kw), sample(model, prompts, "compiled", **kw)
    assert_same(eager, compiled, LOGP_ATOL)
    # the loop a CUDA graph replays (off CUDA: the compiled step run again each step), same compiled step
    assert_same(eager, sample(model, prompts, "compiled-graph", **kw), LOGP_ATOL)
    assert len(set(eager.lengths.tolist())) > 3  # rows end apart
    if case == "stop":
        assert compiled.texts(tok, kw["stop_strings"]) == eager.texts(tok, kw["stop_strings"])
        assert sum(not t for t in compiled.truncated.tolist()) > 2


def test_prompts_of_other_lengths_reuse_the_compiled_step(lora_model):
    """GRPO's next step has other prompts: within one PROMPT_BUCKET of lengths nothing compiles again, and
    the tokens still equal the eager sampler's."""
    model, tok, prompts = lora_model
    sample(model, prompts, "compiled")  # compiled (or already, by another test)
    before = graphs()
    longer = [p + tok.encode(" and then some more words") for p in prompts]
    assert max(map(len, longer)) > max(map(len, prompts)) and max(map(len, longer)) <= PROMPT_BUCKET
    assert_same(sample(model, longer, "eager"), sample(model, longer, "compiled"), LOGP_ATOL)
    assert graphs() == before


def ops_per_step(fn) -> tuple[collections.Counter, int]:
    """The host-side ops (top level: not the ones an op calls) that one decode step dispatches, from one
    call of fn, counted by the profiler: everything from the first compiled step on (the steps themselves and
    the loop between them), divided by the number of steps. Returns (op -> per step, steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.events()
    regions = [e for e in events if e.name.startswith("Torch-Compiled Region")]
    assert regions, "no compiled step ran"
    start = min(e.time_range.start for e in regions)

    def top_level(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith(DISPATCHED):
                return False
            p = p.cpu_parent
        return True

    ops = collections.Counter(
        e.name.split("::")[1]
        for e in events
        if e.name.startswith(DISPATCHED) and e.time_range.start >= start and top_level(e)
    )
    return collections.Counter({k: v / len(regions) for k, v in ops.items()}), len(regions)


def test_a_compiled_step_dispatches_at_most_50_ops_besides_the_matmuls(lora_model):
    """Host-side ops per decode step, captured path, LoRA on every projection, 28 layers: the matmuls (a
    packed q|k|v, o, gate|up and down per layer, attention's four, the LM head) and at most 50 others, where
    the eager step dispatches thousands."""
    model, _, prompts = lora_model
    sample(model, prompts, "compiled")  # compiled outside the profile
    ops, steps = ops_per_step(lambda: sample(model, prompts, "compiled"))
    matmuls = sum(v for k, v in ops.items() if k in MATMULS)
    other = {k: round(v, 2) for k, v in ops.items() if k not in MATMULS}
    print(
        f"compiled: {steps} steps; per step {matmuls:.0f} matmuls and {sum(other.values()):.1f} other ops: {other}"
    )
    assert steps >= 8 and matmuls >= 4 * 28  # the projections of every layer ran in the counted steps
    assert sum(other.values()) <= 50, other


@pytest.mark.skipif(
    not cpu_capability().onednn_bf16, reason="bf16 samples in float32 on this CPU: no bf16 units"
)
def test_compiled_decode_equals_eager_in_bf16(lively):
    """A bf16 model, the CPU's default dtype where it has bf16 units (bf16 packed weights, a float32 cache):
    the same tokens (inductor rounds to bf16 where eager does: emulate_precision_casts), the log-probs within
    LOGP_ATOL_BF16."""
    model, _, prompts = lively
    bf16 = Transformer.from_pretrained(resolve_model("tiny"), dtype=torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    assert_same(sample(bf16, prompts, "eager"), sample(bf16, prompts, "compiled"), LOGP_ATOL_BF16)


def test_one_compile_per_number_of_keys_read(lively, monkeypatch):
    """The steps read more of the completions' own keys as they go (static_decode.visible_keys; here 12,
    then 24 of 24): one compiled graph for each, made once, the tokens still the eager sampler's."""
    model, _, prompts = lively
    monkeypatch.setattr(kvcache, "MIN_VISIBLE", 12)
    before = graphs()
    assert_same(sample(model, prompts, "eager"), sample(model, prompts, "compiled"), LOGP_ATOL)
    assert graphs() - before == 2
    sample(model, prompts, "compiled")
    assert graphs() - before == 2


@pytest.mark.skipif(CHOSEN, reason="TORCHINDUCTOR_CACHE_DIR names a folder of the user's choice")
def test_the_kernels_are_in_nanogrpos_cache_folder(lora_model):
    """The compiles above wrote their kernels into nanogrpo's private folder (static_decode.
    private_inductor_cache), not inductor's /tmp default that another user could have made first; the
    suite's earlier tests let inductor look at its folder before (it then writes its default into the
    environment), as a training run's start-up may."""
    from nanogrpo.infra.model_cache import cache_dir as nanogrpo_cache

    model, _, prompts = lora_model
    sample(model, prompts, "compiled")
    folder = nanogrpo_cache() / f"inductor-{os.environ.get('ATEN_CPU_CAPABILITY') or 'default'}"
    assert cache_dir() == str(folder) and any(folder.iterdir())
    assert folder.stat().st_mode & 0o777 == 0o700


def test_continuing_a_row_equals_prefilling_its_history_compiled(lively):
    """The compiled decode continues an episode's rows as the other modes do (tests/test_sampling.py runs
    them): here, after this module's compiles, so a first run pays for inductor's set-up once."""
    model, _, prompts = lively
    check_continuation(model, prompts, "compiled")
