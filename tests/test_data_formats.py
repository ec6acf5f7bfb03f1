"""--data.train as CSV, Parquet, a datasets folder or NAME:SPLIT: the same rows as the JSONL, column mapping,
bad rows named by source and row, the missing-package error, and a tiny run from a Parquet file."""

import csv
import json
import sys
from dataclasses import replace

import pytest
from helpers import write_rows

from nanogrpo.config import DataConfig
from nanogrpo.data import column_map, load_task
from nanogrpo.recipes.presets import PRESETS
from nanogrpo_base.rows import DataError

ROWS = [
    {"id": "a", "prompt": "What is the capital of France?", "reference": "Paris", "answer": "Paris"},
    {"id": "b", "prompt": "Opposite of hot, with a comma, and \"quotes\"?", "reference": "cold", "answer": "cold"},
    {"id": "c", "prompt": "Plural of mouse?\nOne word.", "reference": "mice", "answer": "mice"},
]  # fmt: skip
CHAT = [{"id": "d", "prompt": [{"role": "user", "content": "Two plus two?"}], "labels": ["four", "4"]}]


def user(rows):
    return [{k: v for k, v in r.items() if k != "_line"} for r in rows]


def write_csv(path, rows):
    names = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(names)
        for r in rows:
            w.writerow([json.dumps(r[k]) if isinstance(r.get(k), list) else r.get(k, "") for k in names])
    return path


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def save_dataset(path, rows):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["csv", "parquet", "disk"])
@pytest.mark.parametrize("rows", [ROWS, CHAT], ids=["text", "chat"])
def test_each_format_reads_the_same_rows_as_the_jsonl(tmp_path, fmt, rows):
    want = user(load_task(str(write_rows(tmp_path / "x.jsonl", rows)))[0])
    path = {
        "csv": lambda: write_csv(tmp_path / "x.csv", rows),
        "parquet": lambda: write_parquet(tmp_path / "x.parquet", rows),
        "disk": lambda: save_dataset(tmp_path / "x_ds", rows),
    }[fmt]()
    got, source = load_task(str(path))
    assert user(got) == want and source == str(path)
    first = 2 if fmt == "csv" else 0  # a spreadsheet's row number (the header is row 1), or the row index
    assert [r["_line"] for r in got] == list(range(first, first + len(rows)))


def test_rows_without_id_get_their_row_number(tmp_path):
    rows = [{"prompt": "q1", "reference": "a"}, {"prompt": "q2", "reference": "b"}]
    assert [r["id"] for r in load_task(str(write_csv(tmp_path / "x.csv", rows)))[0]] == [2, 3]
    assert [r["id"] for r in load_task(str(write_parquet(tmp_path / "x.parquet", rows)))[0]] == [0, 1]


def test_a_missing_parquet_value_is_a_missing_field(tmp_path):
    rows = [{"prompt": "q1", "reference": "a", "human": 0.5}, {"prompt": "q2", "reference": "b"}]
    got = load_task(str(write_parquet(tmp_path / "x.parquet", rows)))[0]
    assert got[1].keys() == {"prompt", "reference", "id", "_line"} and got[0]["human"] == 0.5


def test_column_mapping(tmp_path):
    raw = [{"question": "Capital of Peru?", "solution": "Lima", "gold": "Lima", "uid": 7, "extra": "x"}]
    cfg = DataConfig(
        prompt_field="question", reference_field="solution", answer_field="gold", rename="uid=id"
    )
    columns = column_map(cfg)
    assert columns == {"uid": "id", "question": "prompt", "solution": "reference", "gold": "answer"}
    want = {"prompt": "Capital of Peru?", "reference": "Lima", "answer": "Lima", "id": 7, "extra": "x"}
    for path in (write_rows(tmp_path / "x.jsonl", raw), write_parquet(tmp_path / "x.parquet", raw)):
        assert user(load_task(str(path), columns=columns)[0]) == [want]
    got = user(load_task(str(write_csv(tmp_path / "x.csv", raw)), columns=columns)[0])
    assert got == [{**want, "id": "7"}]  # CSV cells are text
    with pytest.raises(DataError, match=r"x\.csv:1: no column 'q' \(the column mapped to 'prompt'\)"):
        load_task(str(tmp_path / "x.csv"), columns={"q": "prompt"})
    with pytest.raises(DataError, match=r"x\.jsonl:1: no field 'q'"):
        load_task(str(tmp_path / "x.jsonl"), columns={"q": "prompt"})
    with pytest.raises(ValueError, match="src=dst"):
        column_map(DataConfig(rename="question"))


def test_a_bad_row_is_reported_with_source_and_row(tmp_path):
    rows = [{"prompt": "q1", "reference": "a"}, {"prompt": "", "reference": "b"}]
    csv_path = write_csv(tmp_path / "bad.csv", rows)
    with pytest.raises(DataError, match=rf"^{csv_path}:3: field 'prompt' is empty"):
        load_task(str(csv_path))
    pq_path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=rf"^{pq_path}:1: field 'prompt' is empty"):
        load_task(str(pq_path))
    ds_path = save_dataset(tmp_path / "bad_ds", [{"prompt": "q", "reference": 3}])
    with pytest.raises(DataError, match=rf"^{ds_path}:0: field 'reference' must be a string"):
        load_task(str(ds_path))
    (tmp_path / "json.csv").write_text('prompt,labels\nq,"[""a"", oops]"\n')
    with pytest.raises(DataError, match=r"json\.csv:2: malformed JSON.* in field 'labels'"):
        load_task(str(tmp_path / "json.csv"))
    (tmp_path / "wide.csv").write_text("prompt,reference\nq,a,b\n")
    with pytest.raises(DataError, match=r"wide\.csv:2: 3 cells, the header names 2 columns"):
        load_task(str(tmp_path / "wide.csv"))


def test_a_missing_package_names_the_pip_line(tmp_path, monkeypatch):
    pq_path = write_parquet(tmp_path / "x.parquet", ROWS)
    ds_path = save_dataset(tmp_path / "x_ds", ROWS)
    for name in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if it were not installed
    with pytest.raises(DataError, match=r"needs the optional package 'pyarrow': pip install pyarrow"):
        load_task(str(pq_path))
    with pytest.raises(DataError, match=r"pip install datasets"):
        load_task(str(ds_path))
    with pytest.raises(DataError, match=r"pip install datasets"):
        load_task("someone/some-set:train")


def test_name_split_reads_only_the_local_cache(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(DataError, match=r"no-such/data-set:train: not in the local Hugging Face cache"):
        load_task("no-such/data-set:train")


def test_demo_recipes_and_missing_files_as_before(tmp_path):
    assert load_task("demo")[1] == "demo:train"
    with pytest.raises(DataError, match="no such file"):
        load_task(str(tmp_path / "MISSING.jsonl"))
    with pytest.raises(DataError, match="no such file"):
        load_task(str(tmp_path / "MISSING.csv"))


def test_tiny_run_from_a_parquet_file(tmp_path):
    from nanogrpo.recipes.demo import demo_rows
    from train import main

    rows = [{k: r[k] for k in ("id", "reference", "answer")} | {"prompt": r["prompt"][-1]["content"]}
            for r in demo_rows()[:8]]  # fmt: skip
    path = write_parquet(tmp_path / "train.parquet", rows)
    cfg = replace(PRESETS["tiny"][1], out_dir=str(tmp_path / "run"), steps=1, plots=False)
    main(replace(cfg, data=replace(cfg.data, train=str(path))))
    ms = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in ms] == [1] and 0 <= ms[0]["reward"] <= 1


def test_train_maps_the_columns_of_a_csv(tmp_path):
    """--data.prompt-field / --data.reference-field rename the columns before the rows are checked."""
    from nanogrpo.recipes.demo import demo_rows
    from train import cli, main

    path = tmp_path / "qa.csv"
    lines = ["question,solution"] + [
        f'"{r["prompt"][-1]["content"]}",{r["reference"]}' for r in demo_rows()[:4]
    ]
    path.write_text("\n".join(lines) + "\n")
    args = ["tiny", "--data.train", str(path), "--steps", "1", "--log-samples-every", "1", "--no-plots"]
    with pytest.raises(ValueError, match="missing field 'prompt'"):  # without the mapping
        main(cli([*args, "--out-dir", str(tmp_path / "a")]))
    main(cli([*args, "--data.prompt-field", "question", "--data.reference-field", "solution",
              "--out-dir", str(tmp_path / "b")]))  # fmt: skip
    groups = json.loads((tmp_path / "b" / "samples.jsonl").read_text().splitlines()[0])["groups"]
    assert {g["reference"] for g in groups} <= {r["reference"] for r in demo_rows()[:4]}
