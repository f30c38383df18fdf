"""`hlat-train demo`: train the ``tiny-demo`` Llama on this Python's own standard library.

The corpus (every ``.py`` file of the standard library, about 30 MB, no download) and the
SentencePiece tokenizer trained on it are cached; the run checkpoints and resumes when the
command is run again.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import time
from typing import Any

from hlat_train.config import ConfigError, TrainConfig

DEMO_TOKENIZER_CHARS = 6_000_000

DEMO_VOCAB = 4096


def default_cache_dir() -> str:
    """``$HLAT_CACHE`` or ``~/.cache/hlat``."""
    return os.environ.get("HLAT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hlat")


def stdlib_files(max_files: int | None = None) -> list[str]:
    """The standard library's ``.py`` files (site-packages excluded), in a stable order."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    return files[:max_files] if max_files else files


def build_corpus(
    out_dir: str, max_files: int | None = None, valid_percent: int = 2
) -> tuple[str, str]:
    """Write ``train.arrow`` and ``valid.arrow`` (column ``text``) from the standard library.

    A file goes to validation when a hash of its relative path falls in the first
    ``valid_percent`` of 100 buckets, so the split is the same on every machine and run;
    each side gets at least one file (the lowest bucket is held out where none falls in
    range, the highest trained on where all do). Returns the two paths; existing files with
    rows are reused. Raises :class:`ConfigError` where ``max_files`` gives fewer than two.
    """
    import pyarrow as pa

    if max_files is not None and max_files < 2:
        raise ConfigError(
            f"--max-files {max_files}: the demo needs at least 2 files, one to train on and "
            "one held out for validation"
        )
    train_path = os.path.join(out_dir, "train.arrow")
    valid_path = os.path.join(out_dir, "valid.arrow")
    if _rows(train_path) and _rows(valid_path):
        return train_path, valid_path
    os.makedirs(out_dir, exist_ok=True)
    root = sysconfig.get_paths()["stdlib"]
    files: list[tuple[int, str]] = []
    for path in stdlib_files(max_files):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8
        if not text.strip():
            continue
        rel = os.path.relpath(path, root)
        files.append((int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100, text))
    if len(files) < 2:
        raise ConfigError(
            f"--max-files {max_files}: the first {max_files} standard-library files give "
            f"{len(files)} non-empty UTF-8 file(s); the demo needs at least 2, one to train on "
            "and one held out for validation"
        )
    held_out = [i for i, (bucket, _) in enumerate(files) if bucket < valid_percent]
    if not held_out:
        held_out = [min(range(len(files)), key=lambda i: files[i][0])]
    elif len(held_out) == len(files):
        held_out.remove(max(held_out, key=lambda i: files[i][0]))
    chosen = set(held_out)
    split = {
        "train": [text for i, (_, text) in enumerate(files) if i not in chosen],
        "valid": [text for i, (_, text) in enumerate(files) if i in chosen],
    }
    for name, texts in split.items():
        table = pa.table({"text": pa.array(texts, pa.string())})
        target = train_path if name == "train" else valid_path
        tmp = target + ".tmp"
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            # one record batch per file, as HLAT's loader wanted
            writer.write_table(table, max_chunksize=len(texts))
        os.replace(tmp, target)
    return train_path, valid_path


def _rows(path: str) -> int:
    """Rows of the Arrow file at ``path`` (0 where there is none)."""
    import pyarrow as pa

    if not os.path.exists(path):
        return 0
    with pa.memory_map(path) as source:
        reader = pa.ipc.open_file(source)
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def build_tokenizer(corpus: str, out_dir: str, vocab_size: int = DEMO_VOCAB) -> str:
    """Train (once) the demo's SentencePiece model (Llama-2 settings, so code keeps its
    layout) on the first few MB of the corpus; returns its path."""
    from hlat_data import train_tokenizer

    path = os.path.join(out_dir, f"stdlib-bpe-{vocab_size}.model")
    if not os.path.exists(path):
        tmp = os.path.join(out_dir, f"tmp-{os.getpid()}")
        written = train_tokenizer(corpus, tmp, vocab_size, max_chars=DEMO_TOKENIZER_CHARS)
        os.replace(written, path)
        os.replace(tmp + ".vocab", path[: -len(".model")] + ".vocab")
    return path


def demo_config(
    cache_dir: str,
    out_dir: str,
    overrides: list[str] | None = None,
    *,
    max_files: int | None = None,
    vocab_size: int = DEMO_VOCAB,
) -> TrainConfig:
    """The ``tiny-demo`` preset pointed at the cached corpus and tokenizer; ``overrides``
    are checked before the corpus and tokenizer are built."""
    from hlat_train.validation import validate

    validate(TrainConfig.preset("tiny-demo", list(overrides or [])), check_files=False)
    corpus_dir = os.path.join(
        cache_dir,
        f"stdlib-py{sys.version_info[0]}{sys.version_info[1]}"
        + (f"-{max_files}" if max_files else ""),
    )
    train, valid = build_corpus(corpus_dir, max_files)
    tokenizer = build_tokenizer(train, corpus_dir, vocab_size)
    base = [
        f"--data.paths={_toml_string_list([train])}",
        f"--data.valid_paths={_toml_string_list([valid])}",
        f"--data.tokenizer={_toml_string(tokenizer)}",
        f"--train.out_dir={_toml_string(out_dir)}",
    ]
    return TrainConfig.preset("tiny-demo", base + list(overrides or []))


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_string_list(items: list[str]) -> str:
    return "[" + ", ".join(_toml_string(i) for i in items) + "]"


def run_demo(
    cache_dir: str,
    out_dir: str,
    overrides: list[str] | None = None,
    *,
    max_files: int | None = None,
    vocab_size: int = DEMO_VOCAB,
) -> dict[str, Any]:
    """Build (or reuse) corpus and tokenizer, train, sample from ``train.sample_prompt``."""
    from hlat_train.trainer import Trainer

    start = time.perf_counter()
    config = demo_config(cache_dir, out_dir, overrides, max_files=max_files, vocab_size=vocab_size)
    prepared = time.perf_counter() - start
    print(
        f"hlat-train demo: corpus and tokenizer ready in {prepared:.1f}s under {cache_dir}",
        file=sys.stderr,
    )
    trainer = Trainer(config)
    try:
        summary = trainer.fit()
        if config.train.sample_prompt:
            summary["sample"] = trainer.generate(
                config.train.sample_prompt,
                config.train.sample_tokens,
                temperature=config.train.sample_temperature,
                top_k=config.train.sample_top_k,
                seed=config.train.seed,
            )
    finally:
        trainer.close()
    summary["seconds"] = time.perf_counter() - start
    return summary
