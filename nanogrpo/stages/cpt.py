"""Continued pre-training (--algo cpt): the causal-LM loss over windows of raw text.

CPT teaches a model a domain's text (a textbook, a manual, a codebase) before SFT and GRPO teach it a task.
It is SFT without a prompt: every token of the text is a target, predicted from the tokens before it.

    python train.py --algo cpt --data.train book.txt --data.seq-len 512 --data.overlap 64 --epochs 3

The text. --data.train is a .txt file, a folder of .txt files (every *.txt under it, sorted by path), or a
JSONL file with a string field `text` per row; each file (or row) is one document. --data.dedup first drops
exact repeats of a paragraph across all documents (paragraphs split on blank lines, compared after trimming
whitespace, the first occurrence kept): boilerplate such as headers, licences and page footers would
otherwise be trained on once per copy.

The windows. Each document is tokenised (no special tokens), the EOS token appended (the model learns where
a document ends), and cut into windows of at most --data.seq-len tokens; a window starts --data.overlap
tokens before the previous one ends. Those overlap tokens are the window's context: they sit in the prompt
side of the batch, so the window's first trained tokens are predicted with some text before them, but they
are not trained on again. Every token of a document is therefore trained on exactly once per epoch:

    document  d0 d1 d2 d3 d4 d5 d6 d7 d8 EOS          --data.seq-len 4 --data.overlap 2
    window 0  [S] d0 d1 d2 d3                         context [S]      trained d0..d3
    window 1        d2 d3 d4 d5                       context d2 d3    trained d4 d5
    window 2              d4 d5 d6 d7                 context d4 d5    trained d6 d7
    window 3                    d6 d7 d8 EOS          context d6 d7    trained d8 EOS

The first token of a document has nothing before it to be predicted from: the first window's context is a
start token S, the tokenizer's BOS, or its EOS when it has no BOS (the "end of the previous document", as
when pre-training on concatenated text). With --data.overlap 0 a later window's context is the one token
before it, which is what predicts its first token (consecutive blocks of plain pre-training share that
token too). So a window is at most seq_len + 1 positions, which must fit the model. A window never runs
into the next document (the last one of a document is simply shorter) and never into padding: the batch
pads contexts on the left and trained tokens on the right, and the loss mask leaves the padding out.

Each window row keeps where it came from: `source` (the file, or file:line for JSONL) and `chunk` (its
index within the document), besides the token ids `_ctx` (context) and `_ids` (trained). --epochs counts
passes over the windows and --prompts-per-step is the number of windows per step. The update is SFT's
(sft.sft_update): the NLL per trained token of the step, on all ranks; `ppl` is its exponential.

Departures from Shaping Explanations, which continued pre-training on a ~4M-token corpus of textbooks: windows of up to
4,096 tokens with overlap (here --data.seq-len defaults to 512 and --data.overlap to 0); each chunk carried
metadata of its source title and position (here `source` and `chunk` are kept on the row, for inspection,
but are not put into the text the model reads); 5 epochs (here --epochs, or --steps); full-precision
updates (here a full fine-tune, --lora.r 0, keeps float32 weights and computes in bf16 under autocast on a
GPU, --model.dtype float32 computes in float32 too; LoRA trains adapters on a frozen base); warmup + cosine
(here --optim.warmup-steps and --optim.schedule cosine; the default is a constant lr); and near-duplicate
removal, which is not done here: --data.dedup drops exact paragraph repeats only.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

from tqdm import tqdm

from nanogrpo.config import DataConfig
from nanogrpo.infra import dist
from nanogrpo.model.logprobs import Batch
from nanogrpo.model.sampling import pad_left
from nanogrpo.rollout import make_batch
from nanogrpo.stages import Run
from nanogrpo.stages.sft import pad_right, sft_update
from nanogrpo_base.rows import DataError, read_rows

INPUTS = "a .txt file, a folder of .txt files, or a .jsonl file with a 'text' field per row"
_BLANK_LINE = re.compile(r"\n\s*\n")  # paragraphs are separated by blank lines (spaces on them allowed)
_BAR_FROM = 64  # tokenising this many documents or more shows a progress bar


# ----------------------------------------------------------------------------------------------- the step


def step(run: Run, step: int, rows: list[dict], first: int) -> dict:
    """One CPT step on this rank's windows: the NLL of their trained tokens given their context."""
    t1 = time.perf_counter()
    batch = window_batch(rows, run.policy.pad_id).to(run.device)  # (N, Tp+Tc)
    upd = sft_update(run.policy, run.opt, run.sched, batch, run.cfg)
    loss = dist.sum_floats({"l": upd.loss})["l"]  # each rank holds its share of the step's mean
    m = {"step": step + 1, "loss": loss, "ppl": math.exp(loss) if loss < 700 else float("inf")}
    m.update(t_sample=0.0, t_score=0.0, tokens=upd.tokens, len_mean=upd.tokens / run.cfg.prompts_per_step)
    m.update(grad_norm=upd.grad_norm, t_train=time.perf_counter() - t1)
    return m


def window_batch(rows: list[dict], pad_id: int) -> Batch:
    """Windows -> a batch: the context is the prompt, the trained tokens the completion (under the mask)."""
    p_ids, p_mask = pad_left([r["_ctx"] for r in rows], pad_id)  # (N, Tp) context, left-padded
    c_ids, c_mask = pad_right([r["_ids"] for r in rows], pad_id)  # (N, Tc) trained, right-padded
    return make_batch(p_ids, p_mask, c_ids, c_mask)  # (N, Tp+Tc)


# -------------------------------------------------------------------------------------------- the windows


def load_windows(data_cfg: DataConfig, tok, max_positions: int | None = None) -> list[dict]:
    """The training rows of a CPT run: every window of every document of --data.train (module docstring).

    `max_positions`: the model's positions (None: `max_position_embeddings` of the config.json in the
    tokenizer's folder, which for nanogrpo is the model's folder; no check when there is none)."""
    seq_len, overlap = data_cfg.seq_len, data_cfg.overlap
    limit = max_positions if max_positions is not None else model_positions(tok)
    check_window_flags(seq_len, overlap, limit)
    docs = read_documents(data_cfg.train)
    if data_cfg.dedup:
        docs, dropped, total = dedup_paragraphs(docs)
        if dist.is_main():
            print(f"--data.dedup: dropped {dropped} of {total} paragraphs (exact repeats)")
    docs = [(source, text) for source, text in docs if text.strip()]  # an empty file teaches nothing
    if not docs:
        raise ValueError(f"--data.train {data_cfg.train}: no text found; give {INPUTS}, with some text in it")
    start, eos = start_and_eos(tok)
    windows: list[dict] = []
    n_tokens = 0
    bar = tqdm(docs, desc="tokenising", unit="doc", disable=len(docs) < _BAR_FROM or not dist.is_main())
    for source, text in bar:
        # verbose=False: a document longer than the tokenizer's model_max_length is fine, it is cut below
        ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"] + [eos]
        n_tokens += len(ids)
        for chunk, (ctx, trained) in enumerate(cut_windows(ids, seq_len, overlap, start)):
            windows.append({"source": source, "chunk": chunk, "_ctx": ctx, "_ids": trained})
    if dist.is_main():
        print(
            f"cpt: {len(docs):,} documents, {n_tokens:,} tokens, {len(windows):,} windows "
            f"(--data.seq-len {seq_len}, --data.overlap {overlap})"
        )
    return windows


def cut_windows(ids: list[int], seq_len: int, overlap: int, start: int) -> list[tuple[list[int], list[int]]]:
    """A document's token ids -> its windows, each (context ids, trained ids); the trained ids of all the
    windows, in order, are `ids` exactly once. The first window's context is [start] and it trains the
    first seq_len tokens; each later one trains the next seq_len - overlap tokens, after the `overlap`
    tokens before them (at least one: the token that predicts its first)."""
    windows = [([start], ids[:seq_len])]
    stride, n_ctx = seq_len - overlap, max(overlap, 1)
    for a in range(seq_len, len(ids), stride):
        windows.append((ids[a - n_ctx : a], ids[a : a + stride]))
    return windows


def check_window_flags(seq_len: int, overlap: int, max_positions: int | None) -> None:
    """--data.seq-len and --data.overlap make windows that train something and fit the model."""
    if seq_len < 2:
        raise ValueError(
            f"--data.seq-len {seq_len}: a window needs at least 2 tokens (with 1, the model would only ever "
            "see one token before each prediction); use e.g. --data.seq-len 512"
        )
    if not 0 <= overlap < seq_len:
        raise ValueError(
            f"--data.overlap {overlap}: the tokens a window shares with the one before it must be at least 0 "
            f"and less than --data.seq-len {seq_len}, so that each window trains new tokens; use e.g. "
            f"--data.overlap {seq_len // 8}"
        )
    if max_positions is not None and seq_len + 1 > max_positions:
        raise ValueError(
            f"--data.seq-len {seq_len}: a window and the token before it take {seq_len + 1} positions, and "
            f"the model has {max_positions}; use --data.seq-len {max_positions - 1} or less"
        )


def model_positions(tok) -> int | None:
    """`max_position_embeddings` of the config.json beside the tokenizer (None when there is none)."""
    config = Path(getattr(tok, "name_or_path", "") or ".") / "config.json"
    if not config.is_file():
        return None
    return int(json.loads(config.read_text()).get("max_position_embeddings") or 0) or None


def start_and_eos(tok) -> tuple[int, int]:
    """The start token of a document (BOS, else EOS) and the EOS token that ends it."""
    if tok.eos_token_id is None:
        raise ValueError(
            "--algo cpt: the tokenizer has no EOS token to end each document with; set eos_token in the "
            "model folder's tokenizer_config.json"
        )
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    return int(start), int(tok.eos_token_id)


# ---------------------------------------------------------------------------------------------- the text


def read_documents(train: str) -> list[tuple[str, str]]:
    """(source, text) of each document of --data.train: a .txt file, every *.txt under a folder (sorted),
    or each row's 'text' of a .jsonl file (source 'file:line')."""
    path = Path(train)
    if path.is_dir():
        files = sorted(f for f in path.rglob("*.txt") if f.is_file())
        if not files:
            raise ValueError(
                f"--data.train {train}: no text found, the folder has no .txt files; give {INPUTS}"
            )
        return [(str(f), read_text(f)) for f in files]
    if not path.is_file():
        raise ValueError(
            f"--data.train {train}: no such file or folder; --algo cpt reads raw text: give {INPUTS}"
        )
    if path.suffix == ".jsonl":
        rows = read_rows(path, _check_text, what="a JSONL file with a 'text' field per row")
        return [(f"{path}:{row['_line']}", row["text"]) for row in rows]
    if path.suffix == ".txt":
        return [(str(path), read_text(path))]
    raise ValueError(f"--data.train {train}: --algo cpt reads raw text; give {INPUTS}")


def read_text(path: Path) -> str:
    """A text file as UTF-8 (a byte-order mark is dropped), or a DataError naming it."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte {e.start + 1} of the file); save it as UTF-8") from None


def _check_text(row: dict, where: str) -> None:
    if "text" not in row:
        raise DataError(f"{where}: missing field 'text' (--algo cpt trains on each row's 'text', a string)")
    if not isinstance(row["text"], str):
        raise DataError(f"{where}: field 'text' must be a string, got {type(row['text']).__name__}")


def dedup_paragraphs(docs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], int, int]:
    """--data.dedup: the documents without exact repeats of a paragraph (compared after trimming whitespace;
    the first occurrence, in document order, is kept), the number dropped and the number of paragraphs.
    Kept paragraphs are joined by one blank line."""
    seen: set[str] = set()
    out, dropped, total = [], 0, 0
    for source, text in docs:
        kept = []
        for para in _BLANK_LINE.split(text):
            key = para.strip()
            if not key:
                continue
            total += 1
            if key in seen:
                dropped += 1
                continue
            seen.add(key)
            kept.append(para)
        out.append((source, "\n\n".join(kept)))
    return out, dropped, total
