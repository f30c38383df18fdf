"""Save/load throughput of a ~1 GB state against torch.save/torch.load, default dcp.save/load
and a raw write with fsync (the disk limit), and the training-step stall of an async save.

Run: ``nox -s bench -- packages/hlat-ckpt/benchmarks`` (or pytest --benchmark-only on this
file). Loads read files that were just written, so they mostly measure the page cache and
deserialisation, equally for every peer. Each save peer runs one untimed round first, so
one-time costs (imports at the first save, a first file's allocation) stay out of every
peer's median alike; before each round, untimed, the previous round's checkpoint is deleted
(hlat-ckpt does it in the background, the dcp peer in the setup) and ``os.sync()`` writes
back every dirty page, so that no round pays for the one before. The synchronous Checkpointer save prints its ratio
to ``dcp.save`` of the same run. ``HLAT_CKPT_BENCH_MIB`` sets the size of each of the 16
tensors (default 64 MiB), e.g. 1 to check that the file runs; ``HLAT_CKPT_BENCH_ROUNDS`` the
timed rounds of each peer (default 5: a round of a save on a shared disk varies by 2x);
``HLAT_CKPT_BENCH_GAP_S`` seconds of idleness before each save round, after the sync
(default 0: back to back; in training, saves are minutes apart, and on a virtual disk
with online discard every peer, each writing new files, took 1.6x to 2.6x as long after 5
idle seconds; README).
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from hlat_ckpt import Checkpointer

GB = 1e9
ROUNDS = int(os.environ.get("HLAT_CKPT_BENCH_ROUNDS", "5"))
TENSOR_MIB = int(os.environ.get("HLAT_CKPT_BENCH_MIB", "64"))
GAP_S = float(os.environ.get("HLAT_CKPT_BENCH_GAP_S", "0"))
MEDIANS: dict[str, float] = {}  # save medians of this run, by peer, for the ratios
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Blob(nn.Module):
    """16 fp32 parameters of 64 MiB each (``HLAT_CKPT_BENCH_MIB``): 1.07 GB."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(TENSOR_MIB * 256 * 1024)) for _ in range(16)
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


def settle() -> None:
    """Untimed, before each save round: write back every dirty page, so that no round
    pays for the writes of the one before (or of the peer before); then idle for
    ``HLAT_CKPT_BENCH_GAP_S``."""
    os.sync()
    if GAP_S > 0:
        time.sleep(GAP_S)


def fresh(path) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return str(path)


def fresh_dir(path) -> None:
    """Untimed: the previous round's file deleted and its directory made anew, then
    :func:`settle`; every peer writes a new file each round, as a checkpoint does.

    Note: on a file system that discards freed blocks (ext4 ``-o discard`` on a thin
    virtual disk, as on the machine of the README's figures), writing a new file after a
    deletion can be much slower than overwriting the old one in place; a raw peer that
    overwrote one file took 0.72 s against 1.4 s for a new file after 5 idle seconds."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    settle()


def test_save_raw_write_fsync(benchmark, model, nbytes, out):
    def run():
        with open(out / "raw" / "raw.bin", "wb") as f:
            for p in model.parameters():
                f.write(memoryview(p.detach().numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    benchmark.pedantic(
        run, setup=lambda: fresh_dir(out / "raw"), rounds=ROUNDS, warmup_rounds=1, iterations=1
    )
    report(benchmark, nbytes)
    MEDIANS["raw"] = benchmark.stats.stats.median


def test_save_torch_save(benchmark, model, nbytes, out):
    def run():
        with open(out / "pt" / "model.pt", "wb") as f:
            torch.save(model.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())

    benchmark.pedantic(
        run, setup=lambda: fresh_dir(out / "pt"), rounds=ROUNDS, warmup_rounds=1, iterations=1
    )
    report(benchmark, nbytes)


def test_save_dcp_default(benchmark, model, nbytes, out):
    def run():
        dcp.save(model.state_dict(), checkpoint_id=str(out / "dcp"), no_dist=True)

    def setup():  # the previous round's files deleted, untimed, as hlat-ckpt deletes them
        fresh(out / "dcp")
        settle()

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    report(benchmark, nbytes)
    MEDIANS["dcp.save"] = benchmark.stats.stats.median


@pytest.mark.parametrize("io_threads", [None, 1], ids=["default", "one-thread"])
def test_save_hlat_ckpt_sync(benchmark, model, nbytes, out, capsys, io_threads):
    """What a user gets: the defaults (checksums, RNG state, fsyncs, the commit; one
    process alone: two writing threads), except keep_last=1, so that, like the dcp.save
    peer's round, each round deletes the previous checkpoint; and with one writing thread,
    the default where several ranks share a node."""
    ck = Checkpointer(out, keep_last=1, async_save=False, io_threads=io_threads)
    steps = itertools.count(1)

    def setup():  # the deletion retention runs in the background finished, untimed
        ck.wait()
        settle()

    benchmark.pedantic(
        lambda: ck.save(next(steps), {"model": model}),
        setup=setup,
        rounds=ROUNDS,
        warmup_rounds=1,
        iterations=1,
    )
    report(benchmark, nbytes)
    ck.close()  # the deletion of the last round's predecessor, in the background
    stats = ck.last_save
    assert stats is not None and stats.checksums_in_write == stats.files
    benchmark.extra_info["checksum_s (last round)"] = round(stats.checksum_s, 4)
    median = benchmark.stats.stats.median
    base = MEDIANS.get("dcp.save")
    raw = MEDIANS.get("raw")
    if raw is not None:
        benchmark.extra_info["x raw write"] = round(raw / median, 3)
    if base is not None:
        benchmark.extra_info["x dcp.save"] = round(median / base, 3)
        line = (
            f"Checkpointer(async_save=False, io_threads={ck.io_threads}).save takes "
            f"{median / base:.2f}x the time of dcp.save"
        )
        line += f" ({median:.3f} s / {base:.3f} s, medians of this run)"
        if raw is not None:
            line += f"; {raw / median:.2f}x the speed of a raw write + fsync ({raw:.3f} s)"
    else:
        line = "Checkpointer(async_save=False).save: no dcp.save peer in this run to compare"
    with capsys.disabled():
        print(f"\n{line}")


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
    ck.close()
    benchmark.extra_info["note"] = "stall per save, not throughput"


def test_save_dcp_async_stall(benchmark, model, out):
    """The same stall for ``dcp.async_save`` with its defaults (the peer hlat-ckpt's async
    save is built beside); its previous write finished (untimed) before each round."""
    pending = []

    def setup():
        while pending:
            pending.pop().result()
        fresh(out / "dcp-async")

    def run():
        pending.append(
            dcp.async_save(model.state_dict(), checkpoint_id=str(out / "dcp-async"), no_dist=True)
        )

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS + 1, warmup_rounds=1, iterations=1)
    setup()
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
