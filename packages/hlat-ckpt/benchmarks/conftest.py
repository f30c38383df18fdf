"""Keeps the ~1 GB checkpoint benchmarks out of the test suite (run them with
``nox -s bench``, which passes --benchmark-only)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    if not config.getoption("benchmark_only", default=False):
        skip = pytest.mark.skip(reason="benchmark: run with --benchmark-only (nox -s bench)")
        for item in items:
            if "hlat-ckpt/benchmarks" in str(item.path):
                item.add_marker(skip)
