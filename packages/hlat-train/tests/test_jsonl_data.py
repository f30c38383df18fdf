"""Training straight from JSON lines (gzip), with the bad-record policy."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pytest
from train_helpers import fit, tiny_config

from hlat_data import DataError
from hlat_train import read_metrics


@pytest.fixture(scope="module")
def jsonl(corpus, tmp_path_factory):
    """20 short training documents as a gzip JSON-lines file with one broken line (line 4):
    an epoch is a few steps of the tiny config."""
    with pa.memory_map(corpus["train"]) as source:
        texts = pa.ipc.open_file(source).read_all().column("text").to_pylist()
    lines = [json.dumps({"text": t[:200]}) for t in texts[:20]]
    lines.insert(3, '{"text": "unterminated')
    path = tmp_path_factory.mktemp("jsonl") / "train.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def test_a_bad_line_stops_the_run_naming_it_or_is_skipped_and_counted(corpus, jsonl, tmp_path):
    paths = f'--data.paths=["{jsonl}"]'
    with pytest.raises(DataError, match=r"train\.jsonl\.gz line 4"):
        fit(tiny_config(corpus, tmp_path / "strict", paths, steps=12))
    summary = fit(
        tiny_config(
            corpus,
            tmp_path / "skip",
            paths,
            "--data.on_bad_record=skip",
            steps=12,
        )
    )
    assert summary["step"] == 12
    train = [
        r for r in read_metrics(str(tmp_path / "skip" / "metrics.jsonl")) if r["kind"] == "train"
    ]
    assert train[-1]["bad_records"] == 1
