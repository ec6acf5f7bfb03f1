"""The sampler's fixed-shape decode loop (`--sampling.decode static`): every step has the same shapes.

The eager loop (sampling._generate) slices the cache to the tokens so far, drops ended rows from the batch
and cache, and asks the host after every token whether a row has ended (and, with stop strings, decodes
every row's latest tokens): no two steps look alike, so nothing can be captured as a graph. Here:

- the cache is preallocated to prompt + max_new_tokens (kvcache.StaticGroupedKVCache, a prompt's keys
  still once per group); the step index, positions and lengths are tensors, and attention masks the keys
  not yet written instead of slicing them. A step reads the completions' own keys up to a bucket
  (`visible_keys`: 64, 128, 256, ... slots, at most twice those written), not the whole buffer: each
  bucket is one more compile or recording, a few per call;
- ended rows keep computing, their tokens forced to pad and their log-probs to 0, instead of being dropped;
- the uniforms of every row and step are drawn before the loop, from the same per-prompt generators in
  the same order as the eager loop (a prompt's G per step), so the two sample the same streams;
- EOS checks run on the device; the host looks every `sync_every` steps (one sync) to stop once every
  row has ended, and checks stop strings then (`_StopCheck`: one decode per live row, a per-token check only
  for rows whose text holds a stop string), so the result equals the eager loop's.

`decode_step` is the one step, a function of fixed-shape tensors only. `--sampling.decode compiled` runs it
through torch.compile (inductor, fullgraph, static shapes: `compiled_step`): the step's norms, RoPE, softmax,
sampling and bookkeeping become a few fused kernels, and the packed matmuls stay oneDNN's or MKL's (opaque
custom ops, packed.py). The prompts' keys are then padded to a multiple of PROMPT_BUCKET tokens, so one
compiled graph serves every GRPO step whose prompts fall in the same bucket; a new bucket (or batch, or
max_new_tokens, or bucket of own keys: visible_keys) compiles again. Compiling costs once per process (40-80 s
on a 2-core CPU for a 30-layer model; inductor caches it on disk for the next run, in nanogrpo's cache folder
rather than a shared /tmp: `private_inductor_cache`): it pays on long runs, not on the 60-step demo, so the
default stays eager.

`--sampling.decode graph` (CUDA only) records the step once per own-key bucket as a CUDA graph and replays
it for the bucket's later tokens (`CapturedStep`): one launch for the whole step instead of one per kernel,
no compile. `compiled-graph` records the compiled step. A graph replays fixed addresses, so the step keeps
all its state in tensors that live for the whole call (the cache, `DecodeState`, the uniforms) and its step
index on the device (`DecodeState.step`, advanced by the step itself): within a bucket no argument changes
from one step to the next, and no Python value either. The recordings are made again for every `generate`
call (the buffers are new), each costing about one eager step.

Same tokens as the eager loop with the same generators; log-probs to float32 rounding (the masked softmax
over a bucket of keys and the longer products round differently from the sliced ones). With one generator for
the whole batch the streams match only until the eager loop drops its first ended rows (it then draws fewer
uniforms per step); per-prompt generators (what training uses) always match.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanogrpo.model.kvcache import StaticGroupedKVCache
from nanogrpo.model.rope import LENGTH_DEPENDENT

SYNC_EVERY = 8  # decode steps between host syncs (early stop, stop strings)
MIN_VISIBLE = 64  # own key slots the first steps read; then 128, 256, ... (visible_keys)
PROMPT_BUCKET = 64  # compiled steps: the prompts' keys padded to a multiple of this many tokens
DECODE_LOOPS = ("eager", "static", "compiled", "graph", "compiled-graph")  # --sampling.decode
GRAPHED = ("graph", "compiled-graph")  # the loops that replay a CUDA graph
CAPTURED = ("compiled", *GRAPHED)  # the loops whose step is traced once: no host reads inside it


def check_decode(decode: str, device: torch.device, parallel: str, model_path: str | None = None) -> None:
    """Refuse before the model loads a decode loop that cannot run here: a CUDA graph off CUDA, or around
    FSDP's forward (`parallel` as dist.parallel_mode says), whose Python hooks gather each block's weights;
    a traced step for a model (`model_path`, its config.json read) whose RoPE reads the length on the host."""
    if decode in CAPTURED and model_path is not None:
        from nanogrpo.model.memory import model_config
        from nanogrpo.model.transformer import ModelArgs

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


def check_rope(decode: str, rope_scaling: dict) -> None:
    """A traced step (compiled or recorded) cannot hold RoPE tables that change with the sequence length."""
    kind = rope_scaling.get("rope_type")
    if decode in CAPTURED and kind in LENGTH_DEPENDENT:
        raise ValueError(
            f"--sampling.decode {decode}: this model's RoPE ({kind}) depends on the sequence length, which "
            "its forward reads on the host every step, and a compiled or recorded step cannot: use "
            "--sampling.decode static or eager"
        )


@dataclass
class DecodeState:
    """The tensors one decode step reads and writes, all of fixed shape for the whole call."""

    tokens: torch.Tensor  # (N, max_new) long, the sampled tokens (pad after a row's end)
    logps: torch.Tensor  # (N, max_new) float32, their sampler log-probs (0 after the end)
    length: torch.Tensor  # (N,) long, tokens up to and including the end (max_new while running)
    done: torch.Tensor  # (N,) bool, the row has ended (EOS or stop string)
    next_pos: torch.Tensor  # (N, 1) long, position of each row's first new token
    eos: torch.Tensor  # (E,) long, the EOS ids
    pad: torch.Tensor  # () long, the pad id
    step: torch.Tensor  # (1,) long, t: the completion token the next step feeds (it then samples token t + 1)


def visible_keys(made: int, max_new: int) -> int:
    """The completions' own key slots the step after `made` sampled tokens reads (it writes slot made - 1):
    MIN_VISIBLE, doubled until it holds them, at most max_new. A step then reads at most about twice the keys
    written, where reading the whole buffer made a 256-token step slower than the eager loop's on a CPU; the
    few values each cost one compile (compiled) or recording (graph) per call."""
    visible = MIN_VISIBLE
    while visible < made:
        visible *= 2
    return min(visible, max_new)


def draw_uniforms(generator, P: int, G: int, max_new: int, device) -> torch.Tensor | None:
    """(max_new, N) uniforms for every step and row, in the order the eager loop draws them: per prompt,
    G per step (per-prompt generators); or N per step from one generator (None: torch's default)."""
    if isinstance(generator, (list, tuple)):
        if device.type == "cpu":  # the CPU generator draws serially: one call equals max_new calls of G
            cols = [torch.rand(max_new, G, generator=g) for g in generator]  # each (max_new, G)
        else:  # Philox offsets advance per call: draw as the eager loop does, one call per step
            cols = [torch.stack([torch.rand(G, generator=g, device=device) for _ in range(max_new)])
                    for g in generator]  # fmt: skip
        return torch.cat(cols, 1).to(device)  # (max_new, N)
    return torch.rand(max_new, P * G, generator=generator, device=device)  # (max_new, N)


def record(s: DecodeState, t: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor) -> None:
    """Write step t's (1,) tokens (N,) and log-probs (N,), ended rows as pad and 0 (what the next step
    feeds); mark the rows that hit an EOS id now."""
    tok = torch.where(s.done, s.pad, tok)  # (N,)
    s.tokens[:, t] = tok[:, None]  # an index_put_: in place when compiled (see kvcache.StaticGroupedKVCache)
    s.logps[:, t] = lp.masked_fill(s.done, 0.0)[:, None]
    if len(s.eos):
        # a compare with each EOS id, not torch.isin: for more rows than a few EOS ids CUDA's isin sorts and
        # calls unique(), which reads a size back to the host (no graph can hold that)
        new = (tok[:, None] == s.eos).any(-1) & ~s.done  # (N,)
        s.length.copy_(torch.where(new, t + 1, s.length))
        s.done.logical_or_(new)


def decode_step(model, lm_head, cache, s: DecodeState, u, sample) -> None:
    """One decode step on fixed shapes, all its inputs in `s`: the forward of token t = s.step (as recorded in
    s.tokens), then token t + 1 sampled with the uniforms u[t + 1] (u: (max_new, N, 1), None when greedy) and
    recorded, and s.step advanced. The same tensors every step: what lets a CUDA graph replay it."""
    t = s.step  # (1,)
    tok = s.tokens.index_select(1, t)  # (N, 1) token t, pad for ended rows
    cache.set_step(t)
    h = model(tok, position_ids=s.next_pos + t, kv_cache=cache, return_hidden=True)  # (N, 1, H)
    logits = lm_head(h[:, 0]).float()  # (N, V)
    nxt, lp = sample(logits, None if u is None else u.index_select(0, t + 1)[0])  # (N,), (N,)
    record(s, t + 1, nxt, lp)
    s.step.add_(1)


def private_inductor_cache() -> None:
    """Point inductor's on-disk cache (compiled kernels, loaded as code) at a folder of this user's own,
    unless TORCHINDUCTOR_CACHE_DIR names one already.

    Inductor's default is /tmp/torchinductor_$USER: any user of the machine can make that folder first and
    fill it with kernels this process would then load and run. nanogrpo compiles into its cache folder
    instead (~/.cache/nanogrpo, or $NANOGRPO_CACHE), refusing one that another user owns or may write. A
    process that runs other CPU code paths (ATEN_CPU_CAPABILITY=avx2, as bench/cpu_check.py --avx2 sets) gets
    a folder of its own: inductor reused the kernels one capability compiled in a process of the other, which
    then read out of bounds or crashed (double free). The C++ precompiled headers (~150 MB each) go there too
    (`_headers_into`). Nothing of torch._inductor is imported before the variable is set: importing it makes
    its default folder in /tmp."""
    from nanogrpo.infra.model_cache import cache_dir, storage_error

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # inductor writes its default there once it looks
    if chosen:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
            _headers_into(chosen)
            return  # the user's own choice

    folder = cache_dir() / f"inductor-{os.environ.get('ATEN_CPU_CAPABILITY') or 'default'}"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(cache_dir(), e) from e
    st = folder.stat()
    if (hasattr(os, "getuid") and st.st_uid != os.getuid()) or st.st_mode & 0o022:
        raise RuntimeError(
            f"{folder} holds compiled code this process would run, and another user owns it or may write to "
            f"it (mode {st.st_mode & 0o777:o}): remove it, or set TORCHINDUCTOR_CACHE_DIR to a folder of your own"
        )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    _headers_into(str(folder))


def _headers_into(folder: str) -> None:
    """Inductor's C++ precompiled headers into `folder`/precompiled_headers. Inductor keeps them in
    /tmp/torchinductor_$USER whatever TORCHINDUCTOR_CACHE_DIR says: torch._inductor.codecache computes that
    folder once, at its import, from default_cache_dir(), and reads the module's _HEADER_DIR at every use, so
    it is set here. A torch without that name gets no precompiled headers (slower compiles, nothing in /tmp)."""
    from torch._inductor import codecache, config

    if isinstance(getattr(codecache, "_HEADER_DIR", None), str):
        codecache._HEADER_DIR = os.path.join(folder, "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")
    else:
        config.cpp_cache_precompile_headers = False
        config.aot_inductor.precompile_headers = False


@functools.cache
def compiled_step():
    """decode_step through torch.compile, made once per process (each new shape compiles on first use),
    compiling into `private_inductor_cache`'s folder."""
    private_inductor_cache()
    # one graph per (prompt bucket, batch, max_new, own-key bucket): a long run with several prompt buckets
    # passes dynamo's default of 8 recompiles, past which it would run the step uncompiled, silently
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # bf16 rounded where eager rounds it (inductor otherwise keeps a fused chain's intermediates in float32):
    # the same tokens as the eager sampler, not near-ties drawn the other way
    return torch.compile(
        decode_step, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True}
    )


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


class _StopCheck:
    """Stop strings, checked every few steps on the host with the eager loop's rule: the row ends at the
    first token i whose window (the last `window` tokens up to i) decodes to a text holding a stop string.

    One decode per live row covers all the steps since the last check (window + new tokens): a stop string
    in a window's text is then in this text too, since it only extends the window on the left and right.
    Only the rows whose text holds a stop string (or a U+FFFD from split UTF-8 bytes, or every row when the
    tokenizer rewrites spaces around punctuation) get the per-token check that finds where it ends."""

    def __init__(self, stop_strings: Sequence[str], tokenizer):
        self.stops, self.tok = list(stop_strings), tokenizer
        self.window = max(len(s.encode()) for s in self.stops) + 2  # as sampling._StopStrings
        self.exact_only = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.checked = 0  # steps checked so far

    def __call__(self, s: DecodeState, upto: int) -> None:
        """Check steps checked .. upto - 1 of the rows not ended before them; end the rows that hit."""
        first, w = self.checked, self.window
        lo = max(0, first - w + 1)
        ids, lengths = s.tokens[:, lo:upto].tolist(), s.length.tolist()
        ended_before = (s.done & (s.length <= first)).tolist()
        hits = {}
        rows = [r for r in range(len(ids)) if not ended_before[r]]
        last = {r: min(upto, lengths[r]) for r in rows}  # a row ended by EOS here: up to its EOS
        texts = self.tok.batch_decode([ids[r][: last[r] - lo] for r in rows])
        suspects = [r for r, x in zip(rows, texts) if self.exact_only or "\ufffd" in x or self.hit(x)]
        for r in suspects:
            for i in range(first, last[r]):
                if self.hit(self.tok.decode(ids[r][max(lo, i - w + 1) - lo : i + 1 - lo])):
                    hits[r] = i
                    break
        if hits:
            idx = torch.tensor(list(hits), device=s.length.device)
            s.length[idx] = torch.tensor([i + 1 for i in hits.values()], device=s.length.device)
            s.done[idx] = True
        self.checked = upto

    def hit(self, text: str) -> bool:
        return any(x in text for x in self.stops)


def generate_static(model, lm_head, prompts, G, max_new, sample, eos_ids, stop_strings, tokenizer,
                    generator, pad_id, amp, temperature, prefill, decode: str = "static"):  # fmt: skip
    """sampling._generate's contract (tokens, log-probs, lengths, truncated) on fixed-shape steps.
    `sample(logits, u)` draws one token per row; `prefill` is sampling._prefill; `decode`: 'static',
    'compiled' (each step through `compiled_step`), 'graph' (the step recorded once and replayed:
    CapturedStep) or 'compiled-graph'."""
    check_rope(decode, model.config.rope_scaling)
    compiled, graph = decode in ("compiled", "compiled-graph"), decode in GRAPHED
    dev = model.lm_head_weight.device
    N = len(prompts) * G
    bucket = PROMPT_BUCKET if compiled else 1
    cache_cls = functools.partial(StaticGroupedKVCache, bucket=bucket)
    logits, cache, next_pos = prefill(model, lm_head, prompts, G, max_new, pad_id, amp, cache_cls)
    step = compiled_step() if compiled else decode_step
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=dev)
    s = DecodeState(
        tokens=torch.full((N, max_new), pad_id, dtype=torch.long, device=dev),
        logps=torch.zeros(N, max_new, dtype=torch.float32, device=dev),
        length=torch.full((N,), max_new, dtype=torch.long, device=dev),
        done=torch.zeros(N, dtype=torch.bool, device=dev),
        next_pos=next_pos, eos=eos, pad=torch.tensor(pad_id, device=dev),
        step=torch.zeros(1, dtype=torch.long, device=dev),
    )  # fmt: skip
    u = draw_uniforms(generator, len(prompts), G, max_new, dev) if temperature > 0 else None
    u = None if u is None else u[:, :, None]  # (max_new, N, 1)
    stops = _StopCheck(stop_strings, tokenizer) if stop_strings else None
    tok, lp = sample(logits, None if u is None else u[0])  # (N,) the first token, from the prefill's logits
    record(s, s.step, tok, lp)
    run = lambda: step(model, lm_head, cache, s, u, sample)  # noqa: E731
    recorded: dict[int, CapturedStep] = {}  # graph: one recording per value of cache.visible
    made = 1  # steps sampled so far
    for _ in range(max_new - 1):
        if made % SYNC_EVERY == 0:  # one host sync every SYNC_EVERY steps
            if stops is not None:
                stops(s, made)
            if bool(s.done.all()):
                break
        cache.visible = visible_keys(made, max_new)  # the own keys this step reads: a few values per call
        if graph and cache.visible not in recorded:
            recorded[cache.visible] = CapturedStep(run, dev)
        (recorded[cache.visible] if graph else run)()
        made += 1
    if stops is not None:
        stops(s, made)
    return s
