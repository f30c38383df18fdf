"""Save/load throughput of a ~1 GB state against torch.save/torch.load, default dcp.save/load
and a raw write with fsync (the disk limit), and the training-step stall of an async save.

Run: ``nox -s bench -- packages/hlat-ckpt/benchmarks`` (or pytest --benchmark-only on this
file). Loads read files that were just written, so they mostly measure the page cache and
deserialisation, equally for every peer.
"""

from __future__ import annotations

import itertools
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from hlat_ckpt import Checkpointer

GB = 1e9
ROUNDS = 2
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Blob(nn.Module):
    """16 fp32 parameters of 64 MiB each: 1.07 GB."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(16 * 1024 * 1024)) for _ in range(16)
        )


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Blob()


@pytest.fixture(scope="module")
def nbytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture
def out(tmp_path):
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def report(benchmark, nbytes: int) -> None:
    benchmark.extra_info["GB"] = round(nbytes / GB, 3)
    benchmark.extra_info["GB/s (mean)"] = round(nbytes / GB / benchmark.stats.stats.mean, 3)


def fresh(path) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return str(path)


def test_save_raw_write_fsync(benchmark, model, nbytes, out):
    def run():
        with open(out / "raw.bin", "wb") as f:
            for p in model.parameters():
                f.write(memoryview(p.detach().numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    report(benchmark, nbytes)


def test_save_torch_save(benchmark, model, nbytes, out):
    def run():
        with open(out / "model.pt", "wb") as f:
            torch.save(model.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    report(benchmark, nbytes)


def test_save_dcp_default(benchmark, model, nbytes, out):
    def run():
        dcp.save(model.state_dict(), checkpoint_id=fresh(out / "dcp"), no_dist=True)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    report(benchmark, nbytes)


def test_save_hlat_ckpt_sync(benchmark, model, nbytes, out):
    ck = Checkpointer(out, keep_last=1, async_save=False, save_rng=False)
    steps = itertools.count(1)
    benchmark.pedantic(lambda: ck.save(next(steps), {"model": model}), rounds=ROUNDS, iterations=1)
    report(benchmark, nbytes)


def test_save_hlat_ckpt_async_stall(benchmark, model, nbytes, out):
    """Time save() blocks the training loop; the background write of the previous save is
    finished (untimed setup) before each round, as when saves are far apart."""
    ck = Checkpointer(out, keep_last=1, async_save=True, save_rng=False)
    steps = itertools.count(1)
    benchmark.pedantic(
        lambda: ck.save(next(steps), {"model": model}),
        setup=ck.wait,
        rounds=ROUNDS + 1,
        warmup_rounds=1,
        iterations=1,
    )
    ck.wait()
    benchmark.extra_info["note"] = "stall per save, not throughput"


def test_load_torch_load(benchmark, model, nbytes, out):
    torch.save(model.state_dict(), out / "model.pt")
    benchmark.pedantic(
        lambda: model.load_state_dict(torch.load(out / "model.pt", weights_only=True)),
        rounds=ROUNDS,
        iterations=1,
    )
    report(benchmark, nbytes)


def test_load_dcp_default(benchmark, model, nbytes, out):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(model.state_dict(), checkpoint_id=str(out / "dcp"), no_dist=True)

    def run():
        state = model.state_dict()
        dcp.load(state, checkpoint_id=str(out / "dcp"), no_dist=True)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    report(benchmark, nbytes)


def test_load_hlat_ckpt(benchmark, model, nbytes, out):
    ck = Checkpointer(out, async_save=False, save_rng=False)
    ck.save(1, {"model": model})
    benchmark.pedantic(lambda: ck.load(1, {"model": model}), rounds=ROUNDS, iterations=1)
    report(benchmark, nbytes)
