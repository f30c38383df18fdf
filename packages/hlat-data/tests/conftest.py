"""Fixtures: a small real corpus from Python's standard library and a SentencePiece model
trained on it."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import pyarrow as pa
import pytest

from hlat_data import Tokenizer, train_tokenizer

sys.path.insert(0, str(Path(__file__).parent))  # data_helpers


def stdlib_documents(count: int = 48) -> list[str]:
    """``count`` documents of varied length cut from standard-library sources, plus one
    empty document."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    documents = [text[: 100 + (i * 397) % 2500] for i, text in enumerate(texts)]
    documents.insert(7, "")
    return documents


def write_ipc(path: Path, texts: list, *, stream: bool = False, batch_rows: int = 5) -> Path:
    table = pa.table({"text": pa.array(texts, pa.string()), "id": list(range(len(texts)))})
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with opener(path, table.schema) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    return path


@pytest.fixture(scope="session")
def arrow_writer():
    """``write_ipc(path, texts, stream=False, batch_rows=5)``: writes an Arrow IPC file."""
    return write_ipc


@pytest.fixture(scope="session")
def documents() -> list[str]:
    return stdlib_documents()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, documents) -> Path:
    """The documents as an Arrow IPC file of many small record batches."""
    return write_ipc(tmp_path_factory.mktemp("corpus") / "corpus.arrow", documents)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory, documents) -> str:
    text = tmp_path_factory.mktemp("tok") / "train.txt"
    text.write_text("\n".join(documents))
    return train_tokenizer([str(text)], text.parent / "sp", vocab_size=512)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path) -> Tokenizer:
    return Tokenizer.from_file(tokenizer_path, num_threads=1)
