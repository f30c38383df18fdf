"""Observability on a real run: W&B (offline) with the config and a resume into the same run,
torch.profiler traces of chosen steps, memory snapshots where the device has them, and the
compute time of each logged step."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch.distributed as dist
from train_helpers import tiny_config

from hlat_train import ConfigError, Trainer, read_metrics
from hlat_train.validation import validate


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline ``run-*.wandb`` file.

    The file is a LevelDB-format log (W&B's own): a 7-byte file header, then 32 KiB blocks
    of chunks, each ``crc32 (4) | length (2) | type (1) | data``; a record longer than the
    rest of its block continues in the next block (types FIRST/MIDDLE/LAST), so the bytes
    of one record are not contiguous in the file and must be joined before parsing.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, chunks, records = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # too little room for a chunk header: the block is padded
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunks += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: one record is complete
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def _finished_run_records(folder: Path, timeout: float = 60.0) -> list:
    """The records of the offline run in ``folder`` once its last one, ``exit``, is written:
    W&B's own process writes the file, and on a busy machine it may still be writing when
    ``finish()`` has returned."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        records = [r for p in sorted(folder.glob("run-*.wandb")) for r in _wandb_records(p)]
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            assert "exit" in kinds, f"the run file has no exit record after {timeout} s: {kinds}"
            return records
        time.sleep(0.2)


def _item_key(item) -> str:
    """A W&B record item's name: ``key``, or ``nested_key`` joined by ``/``."""
    return item.key or "/".join(item.nested_key)


def _fit(config) -> dict:
    trainer = Trainer(config)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def test_wandb_profiler_and_compute_time_on_a_run_that_resumes(corpus, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    extra = (
        "--logging.wandb=true",
        "--logging.wandb_project=hlat-test",
        "--logging.profile_steps=[2, 3]",
    )
    config = tiny_config(corpus, out, *extra, steps=4)
    _fit(config)
    run_id = (out / "wandb_run_id").read_text().strip()
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    records = _finished_run_records(runs[0])
    # the metrics and the whole config reach the run
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            values = {_item_key(i): json.loads(i.value_json) for i in r.history.item}
            history[values["_step"]] = values
    assert sorted(history) == [1, 2, 3, 4]
    assert {"tokens_per_s", "grad_norm", "compute_s", "loss"} <= set(history[4])
    assert any("valid/loss" in values for values in history.values())
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == run_id
    # the config comes once resolved, after the run started
    logged = {
        _item_key(i): json.loads(i.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for i in r.config.update
    }
    assert logged["model"] == dataclasses.asdict(config.model)
    assert set(logged) - {"_wandb"} == {f.name for f in dataclasses.fields(config)}

    # the profiler traced steps 2 and 3 only, as a Chrome trace of real operators
    traces = sorted((out / "profile").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)
    assert {"step 2", "step 3"} <= names and "step 1" not in names and "step 4" not in names

    records = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["kind"] == "train"]
    assert all(r["compute_s"] > 0 for r in records)

    # a resumed run logs into the same W&B run
    _fit(tiny_config(corpus, out, *extra[:2], steps=6))
    assert (out / "wandb_run_id").read_text().strip() == run_id
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2


def test_wandb_without_credentials_stops_the_run_before_any_work(corpus, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # settings an earlier run of this process keeps (WANDB_MODE=offline)
    out = tmp_path / "run"
    config = tiny_config(corpus, out, "--logging.wandb=true", steps=2)
    trainer = Trainer(config)
    try:
        with pytest.raises(ConfigError, match=r"logging.wandb = true, but W&B did not start a "
                           r"run: .*API key.*WANDB_MODE=offline"):  # fmt: skip
            trainer.fit()
        assert not hasattr(trainer, "model")  # before the model is built
    finally:
        trainer.close()
    assert not dist.is_initialized()
    assert not (out / "wandb_run_id").exists()


def test_a_set_up_failure_after_wandb_started_finishes_its_run(corpus, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()

    def no_loader(self, dims):
        raise ConfigError("no loader here")

    monkeypatch.setattr(Trainer, "_train_loader", no_loader)
    out = tmp_path / "run"
    trainer = Trainer(tiny_config(corpus, out, "--logging.wandb=true", steps=2))
    try:
        with pytest.raises(ConfigError, match="no loader here"):
            trainer.fit()
    finally:
        trainer.close()
    (run,) = sorted((out / "wandb").glob("offline-run-*"))
    _finished_run_records(run, timeout=20.0)


def test_memory_snapshot_where_the_device_records_allocator_history(corpus, tmp_path, capsys):
    """On CUDA (the tiny config's ``auto`` device where torch sees one) the snapshot after
    the chosen step is a file pytorch.org/memory_viz reads; a CPU has no allocator history:
    the run says so and goes on."""
    import pickle

    import torch

    out = tmp_path / "run"
    config = tiny_config(corpus, out, "--logging.memory_snapshot_step=2", steps=3)
    _fit(config)
    if torch.cuda.is_available():
        (path,) = (out / "memory").glob("*.pickle")
        assert path.name == "rank0_step2.pickle"
        with path.open("rb") as f:
            snapshot = pickle.load(f)
        assert snapshot["segments"]  # the allocator's blocks at step 2
        assert any(snapshot["device_traces"])  # and the history that led there
    else:
        assert "memory snapshots need a CUDA device" in capsys.readouterr().err
        assert not (out / "memory").exists()


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("--logging.profile_steps=[3, 2]", "first <= last"),
        ("--logging.profile_steps=[0]", "first <= last"),
        ("--logging.profile_steps=[1, 2, 3]", r"\[first, last\]"),
        ("--logging.memory_snapshot_step=-1", "at least 0"),
    ],
)
def test_bad_observability_settings_are_refused(corpus, tmp_path, override, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(tiny_config(corpus, tmp_path / "run", override), 1)
    assert not (tmp_path / "run").exists()


def test_a_run_without_wandb_installed_is_refused_before_any_work(corpus, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match="pip install 'hlat-train\\[wandb\\]'"):
        validate(tiny_config(corpus, tmp_path / "run", "--logging.wandb=true"), 1)
    assert not Path(tmp_path / "run").exists()
