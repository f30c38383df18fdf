"""Helpers shared by the hlat-data tests: a loader with the tests' shape, a comparison of
batches field by field, and a deadline for code that must not run for ever."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import numpy as np

from hlat_data import PackedLoader

SEQ, BATCH = 64, 2


def make_loader(source, tokenizer, **overrides) -> PackedLoader:
    """A loader of ``SEQ``-token rows, ``BATCH`` rows a batch, seed 7, blocks of 4."""
    kwargs = dict(seq_len=SEQ, micro_batch_size=BATCH, seed=7, block_size=4)
    kwargs.update(overrides)
    return PackedLoader(source, tokenizer, **kwargs)


def assert_same_batches(expected, actual) -> None:
    assert len(expected) == len(actual)
    for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
        for field in a._fields:
            np.testing.assert_array_equal(
                getattr(a, field), getattr(b, field), err_msg=f"batch {i} {field}"
            )


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Raises ``TimeoutError`` in the main thread after ``seconds``, so that a loop that would
    run for ever fails the test instead of hanging it."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
