"""`hlat-train demo`, shortened: the stdlib corpus, the tokenizer, training, resume, sample."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pytest

from hlat_train import ConfigError, read_metrics
from hlat_train.demo import build_corpus, demo_config, stdlib_files


def test_corpus_is_the_standard_library_split_stably(tmp_path):
    train, valid = build_corpus(str(tmp_path), max_files=200)
    texts = pa.ipc.open_file(train).read_all()["text"].to_pylist()
    held_out = pa.ipc.open_file(valid).read_all()["text"].to_pylist()
    assert 150 < len(texts) + len(held_out) <= 200 and held_out
    assert not set(texts) & set(held_out)
    with open(stdlib_files()[0], encoding="utf-8") as f:
        first = f.read()
    assert first in texts + held_out
    assert build_corpus(str(tmp_path), max_files=200) == (train, valid)  # cached


@pytest.mark.parametrize("max_files", [2, 10, 20, 40])
def test_a_few_files_still_give_a_training_and_a_held_out_file(tmp_path, max_files):
    train, valid = build_corpus(str(tmp_path), max_files=max_files)
    texts = pa.ipc.open_file(train).read_all()["text"].to_pylist()
    held_out = pa.ipc.open_file(valid).read_all()["text"].to_pylist()
    assert texts and held_out and not set(texts) & set(held_out)


def test_a_cached_empty_held_out_file_is_built_again(tmp_path):
    empty = pa.table({"text": pa.array([], pa.string())})
    for name in ("train.arrow", "valid.arrow"):
        with (
            pa.OSFile(str(tmp_path / name), "wb") as sink,
            pa.ipc.new_file(sink, empty.schema) as writer,
        ):
            writer.write_table(empty)
    _, valid = build_corpus(str(tmp_path), max_files=20)
    assert pa.ipc.open_file(valid).read_all().num_rows >= 1


def test_too_few_files_are_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="--max-files 1: the demo needs at least 2 files"):
        build_corpus(str(tmp_path / "one"), max_files=1)
    assert not (tmp_path / "one").exists()


def test_the_overrides_are_checked_before_the_corpus_is_built(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'train\.stepz'"):
        demo_config(str(tmp_path / "cache"), str(tmp_path / "run"), ["--train.stepz=3"])
    with pytest.raises(ConfigError, match=r"train\.steps must be at least 1"):
        demo_config(str(tmp_path / "cache"), str(tmp_path / "run"), ["--train.steps=-1"])
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_demo_trains_checkpoints_samples_and_resumes_when_run_again(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "hlat_train",
        "demo",
        "--out",
        str(tmp_path / "run"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--max-files",
        "120",
        "--vocab-size",
        "512",
        "--train.steps=3",
        "--optim.warmup_steps=1",
        "--train.eval_every=3",
        "--train.sample_tokens=6",
        "--logging.progress=false",
        "--optim.impl=reference",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "loss" in first.stdout and "sample:\ndef " in first.stdout
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["step"] == 3 and summary["resumed_from"] is None
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["kind"] for r in records] == ["train", "train", "checkpoint", "train", "valid"]
    assert (tmp_path / "run" / "training.png").exists()
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to train: already at step 3" in again.stdout
    assert json.loads(again.stdout.strip().splitlines()[-1])["resumed_from"] == 3
