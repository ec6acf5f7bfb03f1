"""The sampler against transformers' generate and against full recomputation without a KV cache."""

import pytest
import torch
from helpers import check_continuation, completions, per_prompt
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanogrpo.model.fast.row_sampler import Sampler
from nanogrpo.model.fast.sampler import generate, sampling_weights
from nanogrpo.model.sampling import sample_tokens
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import resolve_model

TEXTS = ["The capital of France is", "What is 12 + 35?", "yes", "<think>I add the numbers.</think> answer"]


@pytest.fixture(scope="module")
def tiny_dir():
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def lively_dir(tmp_path_factory, tiny_dir):
    """The zoo's tiny model with larger random weights: its greedy text varies instead of repeating one
    token, so token-for-token comparisons actually exercise something."""
    out = tmp_path_factory.mktemp("lively")
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in hf.parameters():
            if w.ndim == 2:
                w.normal_(0, 0.15, generator=g)
    hf.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lively(lively_dir):
    tok = AutoTokenizer.from_pretrained(lively_dir)
    return Transformer.from_pretrained(lively_dir), tok, [tok.encode(t) for t in TEXTS]


def hf_greedy(hf, prompt: list[int], n: int, eos: int | None) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    ids = out[0, len(prompt) :].tolist()
    if eos is not None and eos in ids:
        ids = ids[: ids.index(eos) + 1]
    return ids


def full_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Logits predicting each completion token, from one forward without a cache and without padding."""
    ids = torch.tensor([prompt + completion])
    return model(ids)[0, len(prompt) - 1 : -1].float()  # (T, V)


def check_greedy_matches_hf(path, n_new, eos, texts=TEXTS):
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(t) for t in texts]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = Transformer.from_pretrained(path)
    gen = generate(
        ours, prompts, max_new_tokens=n_new, temperature=0, eos_ids=[eos] if eos is not None else ()
    )
    got = completions(gen)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(hf, p, n_new, eos)
    return got


def test_greedy_matches_transformers_tiny(tiny_dir, lively_dir):
    check_greedy_matches_hf(tiny_dir, 24, None)
    got = check_greedy_matches_hf(lively_dir, 24, None)
    assert len({tuple(g) for g in got}) == len(got) and len(set(got[0])) > 5, "too trivial a test model"


def test_greedy_matches_transformers_with_eos(lively, lively_dir):
    _, _, prompts = lively
    plain = check_greedy_matches_hf(lively_dir, 16, None)
    eos = plain[0][5]  # a token the first completion produces: it must end there, in both
    got = check_greedy_matches_hf(lively_dir, 16, eos)
    assert got[0] == plain[0][: plain[0].index(eos) + 1]


@pytest.mark.slow
def test_greedy_matches_transformers_smollm2():
    path = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name a color.")]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    got = check_greedy_matches_hf(path, 24, tok.eos_token_id, texts=texts)
    assert "Paris" in tok.decode(got[0])  # a real model, really answering


def test_mixed_length_batch_equals_alone(lively):
    model, _, prompts = lively
    batch = completions(generate(model, prompts, max_new_tokens=20, temperature=0, group_size=2))
    for i, p in enumerate(prompts):
        alone = completions(generate(model, [p], max_new_tokens=20, temperature=0))[0]
        assert batch[2 * i] == alone and batch[2 * i + 1] == alone


def test_kv_cache_greedy_equals_recompute(lively):
    model, _, prompts = lively
    gen = generate(model, prompts, max_new_tokens=20, temperature=0)
    for i, (p, c) in enumerate(zip(prompts, completions(gen))):
        logits = full_logits(model, p, c)  # (T, V)
        assert logits.argmax(-1).tolist() == c
        ref = logits.log_softmax(-1).gather(1, torch.tensor(c)[:, None]).squeeze(1)
        torch.testing.assert_close(gen.logp[i, : len(c)], ref, atol=1e-4, rtol=0)


# with many EOS ids, rows end at different steps and the batch shrinks mid-generation
MANY_EOS = tuple(range(3, 1024, 9))


@pytest.mark.parametrize(
    "temperature,top_k,top_p,eos",
    [
        (1.0, 0, 1.0, ()),
        (0.7, 20, 0.9, ()),
        (1.3, 0, 0.5, ()),
        (1.0, 0, 1.0, MANY_EOS),
        (0.8, 50, 0.95, MANY_EOS),
    ],
)
def test_sampled_logp_equals_recompute(lively, temperature, top_k, top_p, eos):
    """logp is under softmax(logits / T) before filtering, as the trainer recomputes it; tokens obey top-k."""
    model, _, prompts = lively
    gen = generate(
        model,
        prompts,
        group_size=3,
        max_new_tokens=12,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_ids=eos,
        generator=torch.Generator().manual_seed(1),
    )
    assert gen.logp.dtype == torch.float32 and gen.completion_ids.shape[0] == 3 * len(prompts)
    lengths = gen.lengths.tolist()
    if eos:
        assert len(set(lengths)) > 2, "the EOS case should end rows at different steps"
    for row, c in enumerate(completions(gen)):
        assert (c[-1] in eos) == (not gen.truncated[row]) and not any(t in eos for t in c[:-1])
        logits = full_logits(model, prompts[row // 3], c) / temperature  # (T, V)
        ref = logits.log_softmax(-1).gather(1, torch.tensor(c)[:, None]).squeeze(1)
        torch.testing.assert_close(gen.logp[row, : len(c)], ref, atol=1e-4, rtol=0)
        if top_k:
            kth = logits.topk(top_k, -1).values[:, -1]
            assert (logits.gather(1, torch.tensor(c)[:, None]).squeeze(1) >= kth - 1e-4).all()


def test_seeded_sample_is_reproducible(lively):
    model, _, prompts = lively
    run = lambda seed: generate(
        model,
        prompts,
        group_size=4,
        max_new_tokens=10,
        top_p=0.95,
        generator=torch.Generator().manual_seed(seed),
    )
    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logp, b.logp)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # the G completions of a prompt are separate samples, not copies
    assert len({tuple(r) for r in a.completion_ids[:4].tolist()}) > 1


def test_autocast_is_for_accelerators_only(lively):
    """generate(autocast=bf16) on the CPU samples exactly as without it (the packed float32 weights are the
    fast path there); on an accelerator it samples under autocast (tests/test_standin.py)."""
    model, _, prompts = lively
    kw = dict(group_size=2, max_new_tokens=6)
    a = generate(model, prompts, **kw, generator=torch.Generator().manual_seed(3))
    b = generate(model, prompts, **kw, generator=torch.Generator().manual_seed(3), autocast=torch.bfloat16)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logp, b.logp)


def test_eos_ends_completion_and_mask(lively):
    model, _, prompts = lively
    plain = completions(generate(model, prompts, max_new_tokens=16, temperature=0, group_size=2))
    eos = plain[0][6]
    gen = generate(
        model, prompts, max_new_tokens=16, temperature=0, group_size=2, eos_ids=[9999, eos], pad_id=3
    )
    for row, full in enumerate(plain):
        n = full.index(eos) + 1 if eos in full else 16
        assert gen.lengths[row] == n and bool(gen.truncated[row]) == (eos not in full)
        assert gen.completion_ids[row, :n].tolist() == full[:n]
        assert (gen.completion_ids[row, n:] == 3).all() and (gen.logp[row, n:] == 0).all()
        assert gen.mask[row].tolist() == [1.0] * n + [0.0] * (gen.mask.shape[1] - n)
    assert gen.completion_ids.shape[1] == max(gen.lengths.tolist())  # trimmed to the longest


def test_stop_string_ends_at_completing_token(lively):
    model, tok, prompts = lively
    plain = completions(generate(model, prompts, max_new_tokens=16, temperature=0))
    text0 = tok.decode(plain[0])
    stop = text0[len(tok.decode(plain[0][:4])) + 1 :][:3]  # starts inside token 5: ends mid-token or not
    assert len(stop) == 3
    gen = generate(
        model, prompts, max_new_tokens=16, temperature=0, stop_strings=["@@@never", stop], tokenizer=tok
    )
    for row, full in enumerate(plain):
        ends = [n for n in range(1, 17) if stop in tok.decode(full[:n])]
        n = ends[0] if ends else 16
        assert gen.lengths[row] == n and bool(gen.truncated[row]) == (not ends)
        assert gen.completion_ids[row, :n].tolist() == full[:n]
    assert not gen.truncated[0] and stop in gen.texts(tok)[0]


def test_top_k_1_and_tiny_top_p_are_greedy(lively):
    model, _, prompts = lively
    greedy = generate(model, prompts, max_new_tokens=10, temperature=0).completion_ids
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        g = generate(
            model,
            prompts,
            max_new_tokens=10,
            temperature=0.8,
            generator=torch.Generator().manual_seed(0),
            **kw,
        )
        assert torch.equal(g.completion_ids, greedy)


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64 oracle: softmax(logits / T), top-k, then top-p on the renormalised rest, renormalised."""
    z = logits.double() / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k:
        keep &= z >= z.topk(top_k).values[-1]
    p = torch.where(keep, z, -torch.inf).softmax(0)
    if top_p < 1:
        ps, idx = p.sort(descending=True)
        keep[idx[ps.cumsum(0) - ps >= top_p]] = False
    return torch.where(keep, z, -torch.inf).softmax(0)


SMALL = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0])
# a vocabulary that is not a multiple of the draw's block size, with mass spread over many blocks; the
# top-p cases need more than the first partial sort (256 tokens) holds
LARGE = torch.linspace(3.0, -3.0, 5003)[torch.randperm(5003, generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize(
    "logits,temperature,top_k,top_p",
    [
        (SMALL, 1.0, 0, 1.0),
        (SMALL, 0.8, 4, 1.0),
        (SMALL, 1.5, 0, 0.7),
        (SMALL, 0.9, 4, 0.8),
        (LARGE, 1.0, 0, 1.0),
        (LARGE, 0.7, 0, 0.9),
        (LARGE, 2.0, 3000, 0.6),
    ],
)
def test_sample_tokens_distribution(logits, temperature, top_k, top_p):
    """Empirical frequencies of 20k draws match the filtered, renormalised softmax (float64 oracle)."""
    V, n = len(logits), 20_000
    expected = filtered_probs(logits, temperature, top_k, top_p)
    gen = torch.Generator().manual_seed(0)
    draws = [sample_tokens(logits.repeat(2000, 1), temperature, top_p, top_k, gen) for _ in range(n // 2000)]
    tok, lp = torch.cat([d[0] for d in draws]), torch.cat([d[1] for d in draws])
    assert (expected[tok] > 0).all(), "drew a filtered-out token"
    # compare in 20 bins of equal expected mass (rank order), so large vocabularies are tested too
    order = expected.argsort(descending=True)
    bins = torch.empty(V, dtype=torch.long)
    bins[order] = (expected[order].cumsum(0) * 20).long().clamp(max=19)
    freq = torch.bincount(bins[tok], minlength=20).double() / n
    torch.testing.assert_close(freq, torch.bincount(bins, weights=expected, minlength=20), atol=0.01, rtol=0)
    z = logits.double() / temperature
    torch.testing.assert_close(lp.double(), z.log_softmax(0)[tok], atol=1e-5, rtol=0)  # unfiltered logp


def test_bad_arguments_and_training_flag(lively):
    model, _, prompts = lively
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, [[]])
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, prompts, stop_strings=["x"])
    model.train()
    generate(model, prompts[:1], max_new_tokens=2)
    assert model.training
    model.eval()


def test_stop_string_text_is_the_same_in_training_eval_and_final_eval(lively_dir, tmp_path):
    """One rule for the text of a completion that ends on a stop string: it ends right after the stop
    string (kept: format graders check closing tags), and what the completing token carries past it is
    dropped. Training (Generation.texts), eval.py generate (generate_completions) and train.py's final
    eval (base_vs_trained) give the same text."""
    import json
    from dataclasses import replace
    from types import SimpleNamespace

    from nanogrpo.data import render_prompt
    from nanogrpo.eval import generation
    from nanogrpo.model import lora
    from nanogrpo.model.sampling import finish_text
    from nanogrpo.recipes.presets import PRESETS

    model, tok = Transformer.from_pretrained(lively_dir), AutoTokenizer.from_pretrained(lively_dir)
    row = {"id": "a", "prompt": "The capital of France is", "reference": "Paris"}
    prompt = render_prompt(tok, row)
    eos = tuple(sorted({*model.config.eos_token_ids, tok.eos_token_id}))  # what generate_completions uses
    ids = completions(generate(model, [prompt], max_new_tokens=16, temperature=0, eos_ids=eos))[0]
    # the first token that adds 2+ characters completes the stop string: its last 2 characters before
    # the token and the token's first one, so the token carries text past the stop string
    k = next(k for k in range(1, len(ids)) if len(tok.decode(ids[: k + 1])) - len(tok.decode(ids[:k])) >= 2)
    before, upto = tok.decode(ids[:k]), tok.decode(ids[: k + 1])
    stop = before[-2:] + upto[len(before)]
    assert stop not in before and upto.index(stop) + len(stop) < len(upto)
    want = upto[: upto.index(stop) + len(stop)]

    gen = generate(
        model, [prompt], max_new_tokens=16, temperature=0, eos_ids=eos, stop_strings=[stop], tokenizer=tok
    )
    assert gen.lengths.tolist() == [k + 1]  # the sampler stops at the completing token, which is trained on
    assert gen.texts(tok, [stop]) == [want]
    assert finish_text(upto + " and more", ["never", stop]) == want
    kw = dict(max_new_tokens=16, progress=False)
    assert generation.generate_completions(model, tok, [row], stop=(stop,), **kw) == [[want]]

    lora.inject_lora(model, r=2, alpha=4.0, targets=("q_proj",))  # B = 0: base and trained are one model
    cfg = PRESETS["tiny"][1]
    (tmp_path / "held.jsonl").write_text(json.dumps(row) + "\n")
    cfg = replace(
        cfg,
        eval_prompts=1,
        data=replace(cfg.data, eval=str(tmp_path / "held.jsonl"), system_prompt=""),
        sampling=replace(cfg.sampling, stop=(stop,), max_new_tokens=16),
        reward=replace(cfg.reward, spec="rouge_l:1"),
    )
    from nanogrpo.data import load_task
    from nanogrpo.eval.during import final_eval

    held_out = load_task(cfg.data.eval, "eval")
    final_eval(cfg, SimpleNamespace(core=model, tokenizer=tok, use_lora=True), tmp_path, held_out)
    for side in ("base", "trained"):
        got = json.loads((tmp_path / f"eval_{side}.jsonl").read_text())["completion"]
        assert got == want, side


# ---------------------------------------------------------------------------- the plain loop and its fast paths


@pytest.mark.parametrize("case", ["sampled", "eos", "stop", "greedy"])
def test_the_fast_paths_draw_the_plain_loops_tokens(lively, case):
    """The plain loop (a cache row a sample) and the fast paths beside it (the grouped cache with ended rows
    dropped, the default; the grouped cache on fixed shapes under the row sampler's step; that step as the CPU
    runs a recorded one; the row sampler, which continues episodes) draw the same tokens from the same
    generators, log-probs equal to float32 rounding."""
    model, tok, prompts = lively
    kw = {"temperature": 0.0 if case == "greedy" else 1.0}
    if case in ("eos", "stop"):
        kw["eos_ids"] = MANY_EOS
    if case == "stop":
        texts = generate(model, prompts, group_size=3, max_new_tokens=24, generator=per_prompt(4), **kw)
        texts = texts.texts(tok)
        kw.update(tokenizer=tok, stop_strings=[texts[0][6:9], texts[4][12:14], "@@never"])
    runs = {
        decode: generate(model, prompts, group_size=3, max_new_tokens=24, generator=per_prompt(4), decode=decode, **kw)
        for decode in ("plain", "eager", "static", "graph")
    }  # fmt: skip
    runs["rows"] = row_sampler_generate(model, prompts, 3, 24, per_prompt(4), **kw)
    plain = runs.pop("plain")
    assert len(set(plain.lengths.tolist())) > (2 if case in ("eos", "stop") else 0)
    for decode, fast in runs.items():
        assert torch.equal(fast.completion_ids, plain.completion_ids), decode
        assert torch.equal(fast.mask, plain.mask) and torch.equal(fast.truncated, plain.truncated), decode
        torch.testing.assert_close(fast.logp, plain.logp, atol=1e-5, rtol=0)


def row_sampler_generate(model, prompts, G: int, new: int, generator, **kw):
    """generate's first turn through the row sampler (row_sampler.Sampler), as an episode's turn 1 runs."""
    with torch.inference_mode(), sampling_weights(model, len(prompts) * G) as (head, packed, amp):
        sampler = Sampler(model, head, new, packed, amp)
        logits = sampler.prefill(prompts, [i for i in range(len(prompts)) for _ in range(G)])
        return sampler.decode(logits, new, generator, group=G, **kw)


@pytest.mark.parametrize(
    "decode", ["plain", "eager", "static", "graph"]
)  # compiled: test_sampling_compiled.py
def test_continuing_a_row_equals_prefilling_its_history(lively, decode):
    """Three turns of rows that each get their own observation between turns: continued and re-prefilled
    draw the same tokens (helpers.check_continuation), in each decode mode an episode runs with."""
    model, _, prompts = lively
    check_continuation(model, prompts, decode)
