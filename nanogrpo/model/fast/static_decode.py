"""The decode step compiled, or recorded as a CUDA graph (`--sampling.decode compiled | graph | compiled-graph`):
the row sampler's one step (row_sampler.decode_step) wrapped, not a loop of its own.

Every step of that loop has the same shapes: the cache is preallocated, positions and lengths are tensors,
attention reads a fixed number of key slots and masks the ones a row has not written (kvcache.visible_keys:
64, 128, 256, ... slots, at most twice those written; each bucket is one more compile or recording, a few per
call), ended rows keep computing with their tokens forced to pad, and the uniforms of every step are drawn
before the loop. So the step can be captured:

- `compiled`: torch.compile (inductor, fullgraph, static shapes: `compiled_step`): the step's norms, RoPE,
  softmax, sampling and bookkeeping become a few fused kernels, and the packed matmuls stay oneDNN's or MKL's
  (opaque custom ops, packed.py). With the grouped cache the prompts' keys are padded to a multiple of
  PROMPT_BUCKET tokens, so one compiled graph serves every GRPO step whose prompts fall in the same bucket.
  Compiling costs once per process (40-80 s on a 2-core CPU for a 30-layer model; inductor caches it on disk,
  in nanogrpo's cache folder rather than a shared /tmp: infra/model_cache.py's `private_inductor_cache`): it pays on long runs, not
  on the 60-step demo, so the default stays eager.
- `graph` (CUDA only): the step recorded once per key bucket as a CUDA graph and replayed for the bucket's
  later tokens (`CapturedStep`): one launch for the whole step instead of one per kernel, no compile.
  `compiled-graph` records the compiled step. A graph replays fixed addresses, so the step keeps all its
  state in tensors that live for the whole call (the cache, draw.DecodeState, the uniforms) and its step
  index on the device: within a bucket no argument changes from one step to the next, and no Python value
  either. The recordings are made again for every call (the buffers are new), each costing about one step.

The same tokens as the uncompiled step with the same generators; log-probs to float32 rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from nanogrpo.infra import model_cache
from nanogrpo.model.rope import LENGTH_DEPENDENT

PROMPT_BUCKET = 64  # compiled steps over the grouped cache: its prompts' keys padded to a multiple of this
DECODE_LOOPS = ("eager", "plain", "static", "compiled", "graph", "compiled-graph")  # --sampling.decode
COMPILED = ("compiled", "compiled-graph")  # the step through torch.compile
GRAPHED = ("graph", "compiled-graph")  # the step replayed as a CUDA graph
CAPTURED = ("compiled", *GRAPHED)  # the step traced once: no host reads inside it, keys read in buckets


def check_decode(decode: str, device: torch.device, parallel: str, model_path: str | None = None) -> None:
    """Refuse before the model loads a decode loop that cannot run here: a CUDA graph off CUDA, or around
    FSDP's forward (`parallel` as dist.parallel_mode says), whose Python hooks gather each block's weights;
    a traced step for a model (`model_path`, its config.json read) whose RoPE reads the length on the host."""
    if decode in CAPTURED and model_path is not None:
        from nanogrpo.model.hf_config import ModelArgs
        from nanogrpo.model.memory import model_config

        check_rope(decode, ModelArgs.from_hf(model_config(model_path)).rope_scaling)
    if decode in GRAPHED and device.type != "cuda":
        raise ValueError(
            f"--sampling.decode {decode} replays the decode step as a CUDA graph, and this run is on "
            f"{device.type}: use --sampling.decode compiled (torch.compile on the CPU) or static"
        )
    if decode in GRAPHED and parallel == "fsdp":
        raise ValueError(
            f"--sampling.decode {decode}: FSDP gathers each block's weights in Python hooks during the "
            "forward, which a CUDA graph cannot replay: use --sampling.decode static, or --model.parallel ddp"
        )


def check_generate(prompts, generator, group_size: int, max_new_tokens: int, temperature: float, top_p: float,
                   top_k: int, stop_strings, tokenizer, decode: str) -> None:  # fmt: skip
    """sampling.generate's arguments, each refused with what to give instead."""
    if isinstance(generator, (list, tuple)) and len(generator) != len(prompts):
        raise ValueError(f"{len(generator)} generators for {len(prompts)} prompts: give one per prompt")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(
            "generate needs at least one prompt and no empty prompt (give each a token, e.g. BOS)"
        )
    if group_size < 1 or max_new_tokens < 1:
        raise ValueError(f"group_size={group_size}, max_new_tokens={max_new_tokens}: both must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"temperature={temperature} (>= 0), top_p={top_p} (0, 1], top_k={top_k} (>= 0)")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer to decode completions: pass tokenizer=")
    if decode not in DECODE_LOOPS:
        raise ValueError(f"decode={decode!r}: use one of {', '.join(map(repr, DECODE_LOOPS))}")
    if any(s == "" for s in stop_strings):
        raise ValueError("an empty stop string would end every completion at once; remove it")


def check_rope(decode: str, rope_scaling: dict) -> None:
    """A traced step (compiled or recorded) cannot hold RoPE tables that change with the sequence length."""
    kind = rope_scaling.get("rope_type")
    if decode in CAPTURED and kind in LENGTH_DEPENDENT:
        raise ValueError(
            f"--sampling.decode {decode}: this model's RoPE ({kind}) depends on the sequence length, which "
            "its forward reads on the host every step, and a compiled or recorded step cannot: use "
            "--sampling.decode static or eager"
        )


class Stepper:
    """The row sampler's step (row_sampler.decode_step) as --sampling.decode runs it: as it is (static; eager
    and plain for an episode's rows), through torch.compile (compiled), or recorded once per key bucket as a
    CUDA graph and replayed (graph, compiled-graph). Called with the step's arguments, the same tensors every
    step, and `key`: the key slots the step reads (a new bucket, a new recording)."""

    def __init__(self, step: Callable[..., None], decode: str, device: torch.device):
        self.step = compiled_step(step) if decode in COMPILED else step
        self.graph, self.device = decode in GRAPHED, device
        self.recorded: dict[int, CapturedStep] = {}

    def __call__(self, *args, key: int) -> None:
        if not self.graph:
            self.step(*args)
            return
        if key not in self.recorded:
            self.recorded[key] = CapturedStep(lambda: self.step(*args), self.device)
        self.recorded[key]()


@functools.cache
def compiled_step(step: Callable[..., None]) -> Callable[..., None]:
    """`step` through torch.compile, made once per process (each new shape compiles on first use), compiling
    into model_cache.private_inductor_cache's folder."""
    model_cache.private_inductor_cache()
    # one graph per (prompt bucket, batch, max_new, key bucket): a long run with several prompt buckets passes
    # dynamo's default of 8 recompiles, past which it would run the step uncompiled, silently
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # bf16 rounded where eager rounds it (inductor otherwise keeps a fused chain's intermediates in float32):
    # the same tokens as the eager sampler, not near-ties drawn the other way
    return torch.compile(step, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})


class CapturedStep:
    """A decode step recorded as a CUDA graph: the first call runs `run` for real on a side stream (what
    capture asks for: cuBLAS and a compiled step warm up there), then records it, which runs nothing; every
    later call replays the recording. `run` must read and write only tensors that outlive the loop and take
    no decision on the host (decode_step over one DecodeState does both).

    Off CUDA there is no graph: every call runs `run` again. That is the loop the CPU tests check against the
    eager sampler, and what the recording holds: the same ops on the same tensors every step."""

    def __init__(self, run, device: torch.device):
        self.run, self.device, self.graph = run, device, None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        elif self.device.type != "cuda":
            self.run()
        else:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.run()  # this step, for real
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a CUDA call from another thread (a reward server's client) does not void the
            # recording; torch.cuda.graph also empties the allocator's cache as it starts, once per call
            try:
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self.run()  # recorded only: the state stays where the step above left it
            except RuntimeError as e:  # an op that reads back to the host, or one CUDA cannot record
                raise RuntimeError(
                    f"recording the decode step as a CUDA graph failed: {e}\nSample with --sampling.decode "
                    "static (or compiled) instead; tests/test_sampling_static.py's recording tests show which op"
                ) from e
            self.graph = graph
