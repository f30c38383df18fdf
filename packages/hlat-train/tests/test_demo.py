"""`hlat-train demo`, shortened: the stdlib corpus, the tokenizer, training, resume, sample."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pytest

from hlat_train import read_metrics
from hlat_train.demo import build_corpus, stdlib_files


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
