"""Fixtures of every package's tests (their README examples, an S3 endpoint on loopback, the
reuse scripts) and the order of the collected tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test files with ``slow`` (multi-process) tests run first, each file's tests in their
    order; benchmarks (``packages/*/benchmarks``) run only under ``--benchmark-only`` (``nox -s
    bench``): they take minutes and measure, rather than check, behaviour.

    Note: pytest-xdist hands whole files to its workers in this order (``--dist loadfile``);
    with the longest files last, one worker still ran one of them after the other had
    finished everything else."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order kept otherwise
    if config.getoption("benchmark_only", default=False):
        return
    skip = pytest.mark.skip(reason="benchmark: run with --benchmark-only (nox -s bench)")
    for item in items:
        if "benchmarks" in item.path.parts[:-1]:
            item.add_marker(skip)


@pytest.fixture
def run_readme(request, tmp_path, monkeypatch):
    """``run_readme(edit=None)``: runs the ```python blocks of the README of the package whose
    test asks (``packages/<name>/README.md``), as they are written, in order and in one
    namespace (a later block uses what an earlier one made), which it returns. They run in
    ``tmp_path``, the current directory while the test runs. ``edit(block)`` changes each
    block's code first."""
    readme = Path(request.path).parents[1] / "README.md"
    monkeypatch.chdir(tmp_path)

    def run(edit=None) -> dict:
        blocks = _BLOCK.findall(readme.read_text())
        assert blocks, f"{readme} has no python example"
        namespace: dict = {"__name__": "__readme__"}
        for block in blocks:
            code = block if edit is None else edit(block)
            exec(compile(code, str(readme), "exec"), namespace)
        return namespace

    return run


# --- an S3 endpoint on loopback, for tests of s3:// paths -------------------------------------


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 for the whole test session.

    Yields ``storage_options`` for fsspec/s3fs (``fsspec.open(url, **storage_options)``).
    Skips when ``moto[server]`` or ``s3fs`` is not installed.
    """
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto server did not start on {endpoint}") from None
            time.sleep(0.1)
    saved = {
        k: os.environ.get(k)
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL",
        )
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    try:
        yield {
            "endpoint_url": endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint},
        }
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh, empty bucket on the loopback S3 server: yields ``(url, storage_options)``
    with ``url`` like ``s3://test-<name>``."""
    import re
    import uuid

    import s3fs

    options = {k: v for k, v in s3_server.items() if k != "endpoint_url"}
    fs = s3fs.S3FileSystem(**options)
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    bucket = f"t-{name}-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    yield f"s3://{bucket}", options


# --- the scripts of docs/reuse, loaded as modules --------------------------------------------


@pytest.fixture(scope="session")
def reuse_example():
    """``reuse_example("name")``: the module of ``docs/reuse/name.py`` (each is a runnable
    document whose functions the tests call)."""
    import importlib.util
    import sys

    def load(name: str):
        path = Path(__file__).parent / "docs" / "reuse" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"reuse_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and pickling resolve through it
        spec.loader.exec_module(module)
        return module

    return load
