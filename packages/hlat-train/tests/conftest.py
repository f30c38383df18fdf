"""Fixtures: a small real corpus (standard-library source) in Arrow files, a SentencePiece
model trained on it, and a tiny-model config that trains in a second or two."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pytest

from hlat_train.demo import stdlib_files

sys.path.insert(0, str(Path(__file__).parent))


def _write_arrow(path: Path, texts: list[str]) -> str:
    table = pa.table({"text": pa.array(texts, pa.string())})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return str(path)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, str]:
    """``train``/``valid`` Arrow files of standard-library modules and a 384-piece BPE model."""
    from hlat_data import train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    texts = []
    for path in stdlib_files()[:400]:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if len(text) > 200:
            texts.append(text[:3000])
        if len(texts) == 64:
            break
    train = _write_arrow(root / "train.arrow", texts[:56])
    valid = _write_arrow(root / "valid.arrow", texts[56:])
    tokenizer = train_tokenizer(train, str(root / "bpe.model"), vocab_size=384)
    return {"train": train, "valid": valid, "tokenizer": tokenizer}
