"""--algo cpt: windows of raw text (every token trained once, context from the overlap, no crossing into
the next document or into padding), the three input forms, --data.dedup, the start-up errors, and tiny runs
that lower their loss (LoRA and full fine-tuning), follow --epochs and resume."""

import json
import math

import pytest
import torch
from helpers import metrics

from nanogrpo.config import DataConfig
from nanogrpo.stages.cpt import cut_windows, dedup_paragraphs, load_windows, window_batch
from train import cli, main

WORDS = "the cat sat on a mat while the dog ran to the park and back again under a grey sky".split()


def prose(seed: int, n_words: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n_words,), generator=g))


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def data(train, **kw) -> DataConfig:
    return DataConfig(train=str(train), **{"seq_len": 16, "overlap": 4, **kw})


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def by_document(windows: list[dict]) -> dict[str, list[dict]]:
    docs: dict[str, list[dict]] = {}
    for w in windows:
        docs.setdefault(w["source"], []).append(w)
    return docs


# ---------------------------------------------------------------------------------------------- windows


@pytest.mark.parametrize("seq_len", [2, 3, 5, 8])
def test_windows_train_every_token_once_after_their_overlap(seq_len):
    start = -1
    for overlap in range(seq_len):
        for n in range(1, 30):
            ids = list(range(100, 100 + n))
            wins = cut_windows(ids, seq_len, overlap, start)
            assert [t for _, t in wins] and sum((t for _, t in wins), []) == ids  # each token once, in order
            assert wins[0] == ([start], ids[:seq_len])  # the start token predicts the first one
            for k in range(1, len(wins)):
                ctx, trained = wins[k]
                seen = wins[k - 1][0] + wins[k - 1][1]  # the window before: context and trained
                assert ctx == seen[-max(overlap, 1) :]  # overlap 0: the one token that predicts it
                assert 1 <= len(trained) <= seq_len - overlap and start not in ctx
                assert len(ctx) + len(trained) <= seq_len + (overlap == 0)
            assert len(wins) == 1 + max(0, math.ceil((n - seq_len) / (seq_len - overlap)))


def test_txt_file_windows_keep_source_chunk_and_document(tmp_path, tok):
    text = prose(0, 60)
    path = tmp_path / "book.txt"
    path.write_text(text)
    wins = load_windows(data(path), tok)
    ids = encode(tok, text)
    assert len(ids) > 40 and tok.bos_token_id is None  # the tiny tokenizer: EOS is the start token
    assert [w["chunk"] for w in wins] == list(range(len(wins))) and {w["source"] for w in wins} == {str(path)}
    assert sum((w["_ids"] for w in wins), []) == ids and wins[0]["_ctx"] == [tok.eos_token_id]
    assert all(len(w["_ctx"]) + len(w["_ids"]) <= 16 for w in wins[1:]) and len(wins[0]["_ids"]) == 16
    assert len(load_windows(data(path, seq_len=8, overlap=0), tok)) == math.ceil(len(ids) / 8)


def test_folder_and_jsonl_documents_never_share_a_window(tmp_path, tok):
    texts = {"b.txt": prose(1, 30), "a.txt": prose(2, 12), "sub/c.txt": prose(3, 50)}
    for name, text in texts.items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(text)
    (tmp_path / "docs" / "notes.md").write_text("not a .txt: left out")
    wins = load_windows(data(tmp_path / "docs"), tok)
    docs = by_document(wins)
    assert list(docs) == [str(tmp_path / "docs" / n) for n in ("a.txt", "b.txt", "sub/c.txt")]  # sorted
    for name, text in texts.items():
        got = docs[str(tmp_path / "docs" / name)]
        assert [w["chunk"] for w in got] == list(range(len(got)))
        assert sum((w["_ids"] for w in got), []) == encode(tok, text)  # its own tokens, ending in its EOS

    rows = [{"text": texts["a.txt"], "title": "A"}, {"text": texts["b.txt"]}]
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")  # a blank line: skipped
    docs = by_document(load_windows(data(path), tok))
    assert list(docs) == [f"{path}:1", f"{path}:3"]  # file:line
    assert [sum((w["_ids"] for w in d), []) for d in docs.values()] == [encode(tok, r["text"]) for r in rows]


def test_padding_does_not_reach_a_window(tmp_path, tok, tiny_model_dir):
    """In a batch of windows of different lengths each window's log-probs are those it has alone."""
    from nanogrpo.model.logprobs import completion_logprobs
    from nanogrpo.model.transformer import Transformer

    path = tmp_path / "t.txt"
    path.write_text(prose(4, 40))
    wins = load_windows(data(path, seq_len=12, overlap=3), tok)
    rows = [wins[0], wins[-1], wins[1]]  # context 1 / 3 tokens, a short last window
    assert len({len(w["_ids"]) for w in rows}) > 1
    batch = window_batch(rows, pad_id=0)
    assert batch.mask.sum() == sum(len(w["_ids"]) for w in rows)
    assert batch.targets[batch.mask.bool()].tolist() == sum((w["_ids"] for w in rows), [])
    model = Transformer.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        together = completion_logprobs(model, batch)[0]  # (3, Tc)
        for i, w in enumerate(rows):
            alone = completion_logprobs(model, window_batch([w], pad_id=0))[0][0]  # (len,)
            torch.testing.assert_close(together[i, : len(w["_ids"])], alone, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ dedup


def test_dedup_drops_exact_repeated_paragraphs_only(tmp_path, tok, capsys):
    notice = "Copyright 2024 The Press. All rights reserved."
    docs = [
        ("a", f"Chapter one.\n\n{notice}\n\nThe cat sat."),
        ("b", f"  {notice}  \n \n\n\nThe cat sat!\n\nChapter one. More."),  # the notice again, padded
        ("c", f"{notice}\n\nChapter one."),  # both repeats: an empty document
    ]
    out, dropped, total = dedup_paragraphs(docs)
    assert (dropped, total) == (3, 8)
    assert out == [
        ("a", f"Chapter one.\n\n{notice}\n\nThe cat sat."),  # the first occurrence is kept
        ("b", "The cat sat!\n\nChapter one. More."),  # a near-duplicate and a superset are not exact repeats
        ("c", ""),
    ]
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, text in docs:
        (folder / f"{name}.txt").write_text(text)
    wins = load_windows(data(folder, dedup=True), tok)
    assert "dropped 3 of 8 paragraphs" in capsys.readouterr().out
    assert sorted(by_document(wins)) == [str(folder / "a.txt"), str(folder / "b.txt")]  # c is empty now
    assert len(load_windows(data(folder), tok)) > len(wins)  # without --data.dedup nothing is dropped


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"overlap": 16}, "--data.overlap 16"),
        ({"overlap": -1}, "--data.overlap -1"),
        ({"seq_len": 1, "overlap": 0}, "--data.seq-len 1"),
        ({"seq_len": 1024}, "use --data.seq-len 1023 or less"),  # the tiny model has 1024 positions
    ],
)
def test_bad_window_flags_say_what_to_use(tmp_path, tok, kw, needle):
    (tmp_path / "t.txt").write_text("some text")
    with pytest.raises(ValueError, match=needle):
        load_windows(data(tmp_path / "t.txt", **kw), tok)
    assert load_windows(data(tmp_path / "t.txt", seq_len=1023), tok)


def test_bad_text_is_refused_naming_file_and_line(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: missing field 'text'"):
        load_windows(data(path), tok)
    path.write_text('{"text": "fine"}\n\n{"text": 3}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: field 'text' must be a string, got int"):
        load_windows(data(path), tok)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text(" \n\n ")
    with pytest.raises(ValueError, match="no text found"):
        load_windows(data(tmp_path / "empty"), tok)


def test_cpt_needs_raw_text(tmp_path, tok):
    (tmp_path / "x").mkdir()
    with pytest.raises(ValueError, match="the folder has no .txt files"):
        load_windows(data(tmp_path / "x"), tok)
    with pytest.raises(ValueError, match="--data.train demo: no such file or folder; --algo cpt reads raw"):
        load_windows(data("demo"), tok)


# ------------------------------------------------------------------------------------------------- runs


def cpt_args(tmp_path, text: str) -> list[str]:
    """`train.py tiny --algo cpt` on `text`, in windows of 16 tokens that overlap by 4 (no plots)."""
    path = tmp_path / "text.txt"
    path.write_text(text)
    return ["tiny", "--algo", "cpt", "--data.train", str(path), "--data.seq-len", "16", "--data.overlap", "4",
            "--no-plots"]  # fmt: skip


@pytest.mark.parametrize("lora_r, lr", [("4", "1e-2"), ("0", "3e-3")])
def test_cpt_run_lowers_its_loss_over_epochs(tmp_path, tok, lora_r, lr):
    text = prose(5, 72)  # 12 windows: 6 steps of 2 an epoch
    base = cpt_args(tmp_path, text)
    n_win = len(load_windows(data(tmp_path / "text.txt"), tok))
    run = tmp_path / "run"
    args = ["--epochs", "2", "--prompts-per-step", "2", "--lora.r", lora_r, "--optim.lr", lr]
    main(cli([*base, *args, "--out-dir", str(run)]))
    ms = metrics(run)
    assert n_win % 2 == 0 and [m["step"] for m in ms] == list(range(1, n_win + 1))  # ceil(2 * n / 2)
    half = n_win // 2  # one epoch: every window once, so every token of the text once
    assert (
        sum(m["tokens"] for m in ms[:half]) == sum(m["tokens"] for m in ms[half:]) == len(encode(tok, text))
    )
    first, last = (sum(m["loss"] for m in e) / half for e in (ms[:half], ms[half:]))
    assert last < first - 0.05, (first, last)
    assert all(m["ppl"] == pytest.approx(math.exp(m["loss"])) for m in ms)
    assert (run / ("adapter" if lora_r != "0" else "model")).is_dir()


def test_cpt_resume_continues_exactly(tmp_path, tok):
    base = cpt_args(tmp_path, prose(6, 40))
    main(cli([*base, "--steps", "4", "--out-dir", str(tmp_path / "straight")]))
    main(cli([*base, "--steps", "2", "--out-dir", str(tmp_path / "resumed")]))
    main(cli(["--out-dir", str(tmp_path / "resumed"), "--resume", "--steps", "4"]))
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [m["step"] for m in b] == [1, 2, 3, 4] and a == b
