"""Time to the first batch from a large Arrow file (against a small one), locally and over
``s3://``, resident memory over a full epoch, and peak memory of `hlat-data convert` on a
large JSONL file.

Sizes: ``HLAT_DATA_BENCH_GB`` (default 1) gigabytes for the large local files and
``HLAT_DATA_BENCH_S3_MB`` (default 256) megabytes for the file uploaded to the loopback S3
server (which holds objects in memory); the files are written to a temporary directory by
the benchmark itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pyarrow as pa
import pytest

from hlat_data import ArrowSource, PackedLoader, Tokenizer, train_tokenizer

GB = float(os.environ.get("HLAT_DATA_BENCH_GB", "1"))
S3_MB = float(os.environ.get("HLAT_DATA_BENCH_S3_MB", "256"))


def _stdlib_texts(chars: int) -> list[str]:
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(texts[-1])
        if total >= chars:
            break
    return texts


def _write(path: Path, texts: list[str], size: float) -> Path:
    batch = pa.record_batch([pa.array(texts, pa.string())], names=["text"])
    with pa.ipc.new_file(path, batch.schema) as writer:
        for _ in range(max(1, int(size // batch.nbytes))):
            writer.write_batch(batch)
    return path


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    texts = _stdlib_texts(4_000_000)  # one 4 MB record batch of ~500 documents, repeated
    (root / "train.txt").write_text("\n".join(texts[:150]))
    model = train_tokenizer(str(root / "train.txt"), root / "sp", vocab_size=4000)
    large = _write(root / "large.arrow", texts, GB * 1e9)
    small = _write(root / "small.arrow", texts, 1)
    return root, Tokenizer.from_file(model), large, small


def _first_batch(path, tokenizer, workers, storage_options=None):
    start = time.perf_counter()
    source = ArrowSource(path, storage_options=storage_options)
    loader = PackedLoader(source, tokenizer, 4096, 8, num_workers=workers)
    batches = iter(loader)
    next(batches)
    seconds = time.perf_counter() - start
    batches.close()
    return seconds


@pytest.mark.parametrize("workers", [0, 2])
def test_time_to_first_batch_does_not_grow_with_file_size(benchmark, files, workers):
    _, tokenizer, large, small = files
    small_s = _first_batch(small, tokenizer, workers)
    large_s = benchmark.pedantic(
        _first_batch, args=(large, tokenizer, workers), rounds=1, iterations=1
    )
    benchmark.extra_info.update(
        large_file_gb=round(large.stat().st_size / 1e9, 2),
        large_s=round(large_s, 3),
        small_s=round(small_s, 3),
        large_over_small=round(large_s / small_s, 2),
    )
    print(
        f"\nfirst batch, {workers} workers: {large.stat().st_size / 1e9:.2f} GB file {large_s:.3f} s, "
        f"4 MB file {small_s:.3f} s ({large_s / small_s:.2f}x)"
    )


def test_time_to_first_batch_over_s3(benchmark, files, s3_bucket, caplog):
    """Requests and bytes fetched before the first batch, against the object's size.

    Note: moto's server copies the whole object for every ranged GET (about 1 ms per MB
    here), so over loopback the time grows with the object's size even when the bytes
    fetched do not; the bytes and request counts are the file-size-independent figures."""
    import logging

    import fsspec

    root, tokenizer, _, small = files
    url, options = s3_bucket
    fs = fsspec.filesystem("s3", **options)
    large = _write(root / "s3-large.arrow", _stdlib_texts(4_000_000), S3_MB * 1e6)
    fs.put(str(large), f"{url}/large.arrow")
    fs.put(str(small), f"{url}/small.arrow")

    def fetched(run):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="s3fs"):
            seconds = run()
        gets = [r.getMessage() for r in caplog.records]
        ranges = [re.search(r"bytes=(\d+)-(\d+)", m) for m in gets if "get_object" in m]
        if not all(ranges):
            raise AssertionError("a GET without a Range header: the whole object was read")
        return seconds, len(ranges), sum(int(m[2]) + 1 - int(m[1]) for m in ranges if m)

    small_s, small_n, small_b = fetched(
        lambda: _first_batch(f"{url}/small.arrow", tokenizer, 0, options)
    )
    large_s, large_n, large_b = benchmark.pedantic(
        fetched,
        args=(lambda: _first_batch(f"{url}/large.arrow", tokenizer, 0, options),),
        rounds=1,
        iterations=1,
    )
    size_mb = large.stat().st_size / 1e6
    benchmark.extra_info.update(
        large_object_mb=round(size_mb),
        large_s=round(large_s, 3),
        large_requests=large_n,
        large_fetched_mb=round(large_b / 1e6, 2),
        small_s=round(small_s, 3),
        small_requests=small_n,
        small_fetched_mb=round(small_b / 1e6, 2),
    )
    print(
        f"\nfirst batch over s3:// (loopback moto): {size_mb:.0f} MB object: {large_s:.3f} s, "
        f"{large_n} ranged reads, {large_b / 1e6:.2f} MB fetched; 4 MB object: {small_s:.3f} s, "
        f"{small_n} ranged reads, {small_b / 1e6:.2f} MB fetched"
    )


def test_resident_memory_is_flat_over_an_epoch(benchmark, files):
    root, tokenizer, _, _ = files
    path = _write(root / "epoch.arrow", _stdlib_texts(4_000_000), 24e6)  # ~24 MB, ~7M tokens

    def run():
        loader = PackedLoader(
            ArrowSource(path), tokenizer, 4096, 8, num_workers=2, num_epochs=1, block_size=64
        )
        samples = []
        for k, _ in enumerate(loader):
            if k % 5 == 0:
                samples.append(_rss_anon_mb())
        return samples

    samples = benchmark.pedantic(run, rounds=1, iterations=1)
    quarter = max(1, len(samples) // 4)
    # Note: the word cache is this process's one growing structure, bounded by cache_size
    words = len(tokenizer.word_cache) if tokenizer.word_cache is not None else 0
    benchmark.extra_info.update(
        rss_anon_mb_first_quarter=round(max(samples[:quarter]), 1),
        rss_anon_mb_last_quarter=round(max(samples[-quarter:]), 1),
        samples=len(samples),
        word_cache_words=words,
    )
    print(
        f"\nanonymous RSS over an epoch (MB): first quarter max {max(samples[:quarter]):.1f}, "
        f"last quarter max {max(samples[-quarter:]):.1f}, {len(samples)} samples; "
        f"word cache {words} words at the end (at most {tokenizer.cache_size})"
    )


def test_convert_of_a_large_jsonl_keeps_peak_memory_bounded(benchmark, files):
    root, _, _, _ = files
    texts = _stdlib_texts(4_000_000)
    jsonl = root / "large.jsonl"
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    with open(jsonl, "w") as f:
        for _ in range(max(1, int(GB * 1e9 // len(lines)))):
            f.write(lines)

    def run():
        # Note: VmHWM, the peak of this process's own memory; ru_maxrss would also count the
        # benchmark process it was forked from, which Linux carries across exec
        code = (
            "import sys; from hlat_data.cli import main; "
            f"main(['convert', {str(jsonl)!r}, '-o', {str(root / 'converted.arrow')!r}, '--no-progress']); "
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')),"
            " file=sys.stderr)"
        )
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        return int(result.stderr.strip().splitlines()[-1]) / 1024, time.perf_counter() - start

    peak_mb, seconds = benchmark.pedantic(run, rounds=1, iterations=1)
    size_gb = jsonl.stat().st_size / 1e9
    benchmark.extra_info.update(
        jsonl_gb=round(size_gb, 2), peak_rss_mb=round(peak_mb), seconds=round(seconds, 1)
    )
    print(
        f"\nconvert {size_gb:.2f} GB JSONL: peak RSS {peak_mb:.0f} MB, {size_gb * 1e3 / seconds:.0f} MB/s"
    )
