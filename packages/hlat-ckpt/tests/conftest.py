"""Fixtures of the hlat-ckpt tests: a checkpoint root on local disk or on the loopback S3
server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The tests import their helpers (ckpt_helpers, ckpt_workers) from this directory.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """``(url, storage_options)`` of an empty checkpoint root on local disk or S3."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    url, options = request.getfixturevalue("s3_bucket")
    return f"{url}/run", options
