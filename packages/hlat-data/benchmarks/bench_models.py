"""Packed tokens per second for each kind of tokenizer model, against the tokenizer library's
own multi-threaded batch encode of the same documents on the same cores, in the same run:

- a SentencePiece BPE with identity normalization (Llama 2's kind, ``train_tokenizer``'s);
- a SentencePiece BPE with SentencePiece's default normalization (``nmt_nfkc``, whitespace
  collapsed), what most users get from ``spm_train``;
- a Hugging Face ``tokenizers`` byte-level BPE (``tokenizer.json``).

Each is trained with 8k pieces on the first documents of 12 M characters of the standard
library's sources (``HLAT_BENCH_CHARS`` changes the size). The peer is ``SentencePieceProcessor.encode(texts, num_threads=2)`` or
``tokenizers.Tokenizer.encode_batch(texts)`` (its own thread pool); the loader reads one epoch
with ``num_workers`` 0 (tokenized in the calling process, 2 threads) and 2 (worker processes),
seq 2048 x 8, everything else at its defaults. Each figure is the fastest of three rounds, the
loader's from a cold word cache; ratios are printed and kept in ``extra_info``."""

from __future__ import annotations

import io
import os
import sysconfig
import time
from pathlib import Path

import pyarrow as pa
import pytest

from hlat_data import ArrowSource, PackedLoader, Tokenizer

SEQ_LEN, BATCH, ROUNDS = 2048, 8, 3
CHARS = int(os.environ.get("HLAT_BENCH_CHARS", 12_000_000))
PEERS: dict[str, float] = {}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= CHARS:
            break
    table = pa.table({"text": texts})
    with pa.ipc.new_file(root / "corpus.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=64)
    return root, texts


@pytest.fixture(
    scope="module", params=["sentencepiece-identity", "sentencepiece-nmt_nfkc", "tokenizers-bpe"]
)
def model(request, corpus):
    root, texts = corpus
    kind = request.param
    if kind.startswith("sentencepiece"):
        import sentencepiece

        options = (
            {"normalization_rule_name": "identity", "remove_extra_whitespaces": False}
            if kind.endswith("identity")
            else {"normalization_rule_name": "nmt_nfkc"}
        )
        buffer = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(texts[:300]),
            model_writer=buffer,
            vocab_size=8000,
            model_type="bpe",
            byte_fallback=True,
            split_digits=True,
            hard_vocab_limit=False,
            minloglevel=2,
            **options,
        )
        path = root / f"{kind}.model"
        path.write_bytes(buffer.getvalue())
    else:
        import tokenizers

        bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
        bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = tokenizers.decoders.ByteLevel()
        bpe.train_from_iterator(
            texts[:300],
            tokenizers.trainers.BpeTrainer(
                vocab_size=8000,
                special_tokens=["<s>", "</s>"],
                initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            ),
        )
        path = root / f"{kind}.json"
        bpe.save(str(path))
    return kind, str(path)


def _fastest(benchmark, run):
    rounds = []
    benchmark.pedantic(lambda: rounds.append(run()), rounds=ROUNDS, iterations=1)
    return max(rounds, key=lambda r: r[0] / r[1])


def test_library_batch_encode(benchmark, corpus, model):
    _, texts = corpus
    kind, path = model
    if kind.startswith("sentencepiece"):
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_file=path)

        def encode():
            return processor.encode(texts, num_threads=2)
    else:
        import tokenizers

        bpe = tokenizers.Tokenizer.from_file(path)

        def encode():
            return [e.ids for e in bpe.encode_batch(texts, add_special_tokens=False)]

    def run():
        start = time.perf_counter()
        tokens = sum(map(len, encode()))
        return tokens, time.perf_counter() - start

    tokens, seconds = _fastest(benchmark, run)
    PEERS[kind] = tokens / seconds
    benchmark.extra_info.update(model=kind, tokens_per_s=round(tokens / seconds))
    print(f"\n{kind}: library batch encode {tokens / seconds / 1e6:.2f} M tokens/s")


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_loader(benchmark, corpus, model, workers):
    root, _ = corpus
    kind, path = model

    def run():
        tokenizer = Tokenizer.from_file(path, num_threads=2)  # a cold word cache
        start = time.perf_counter()
        loader = PackedLoader(
            ArrowSource(root / "corpus.arrow"),
            tokenizer,
            SEQ_LEN,
            BATCH,
            block_size=16,
            num_workers=workers,
            num_epochs=1,
        )
        tokens = sum(batch.input_ids.size for batch in loader)
        cache = "word cache" if tokenizer.word_cache is not None else "no word cache"
        return tokens, time.perf_counter() - start, cache

    tokens, seconds, cache = _fastest(benchmark, run)
    rate = tokens / seconds
    benchmark.extra_info.update(model=kind, workers=workers, tokens_per_s=round(rate))
    line = f"\n{kind}, num_workers={workers}: {rate / 1e6:.2f} M tokens/s"
    if kind in PEERS:
        benchmark.extra_info["vs_library"] = round(rate / PEERS[kind], 2)
        line += f" = {rate / PEERS[kind]:.2f}x the library's batch encode"
    print(f"{line} ({cache})")
