"""Metrics: peak table and measured CPU peak for MFU, JSONL reading, the plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hlat_train import PEAK_TFLOPS, read_metrics
from hlat_train.metrics import (
    MetricsWriter,
    device_peak_tflops,
    metric_tags,
    plot_metrics,
    table_peak,
)


def test_peak_table_covers_three_trainium_generations_and_the_gpus():
    assert set(PEAK_TFLOPS) == {
        "trainium-neuroncore-v2",
        "trainium2-neuroncore-v3",
        "trainium3-neuroncore-v4",
        "h100",
        "h200",
        "a100",
    }
    assert device_peak_tflops(torch.device("cpu"), "neuron") == (
        95.0,
        "Trainium NeuronCore-v2 (table)",
    )


def test_trn2_and_trn3_peaks_are_per_logical_neuroncore(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    peak, source = table_peak("neuron", "neuron", instance="trn2.48xlarge")
    assert peak == 667.0 / 8 * 2 and "trn2" in source
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert table_peak("neuron", "neuron", instance="trn3.48xlarge")[0] == 671.0 / 8
    assert table_peak("neuron", "neuron", instance=None) is None  # unknown: measured instead


def test_gpus_are_found_by_their_name_whatever_the_device_type():
    assert table_peak("cuda", "NVIDIA H100 80GB HBM3") == (989.0, "H100 (table)")
    assert table_peak("xpu", "Intel Data Center GPU Max 1550") is None


def test_cpu_peak_is_measured():
    peak, source = device_peak_tflops(torch.device("cpu"))
    assert 0.001 < peak < 100 and "measured" in source


def test_a_measured_peak_is_saved_and_reused_on_the_same_machine(tmp_path):
    cache = tmp_path / "run" / "peak_tflops.json"
    peak, source = device_peak_tflops(torch.device("cpu"), cache=str(cache))
    saved = json.loads(cache.read_text())
    assert saved["tflops"] == peak and saved["key"]["threads"] == torch.get_num_threads()
    saved["tflops"] = 123.0  # recognisable: a second call must read it, not measure
    cache.write_text(json.dumps(saved))
    peak, source = device_peak_tflops(torch.device("cpu"), cache=str(cache))
    assert peak == 123.0 and "saved in" in source
    saved["key"]["threads"] += 1  # another thread count is another machine for a matmul
    cache.write_text(json.dumps(saved))
    peak, source = device_peak_tflops(torch.device("cpu"), cache=str(cache))
    assert peak != 123.0 and "saved in" not in source
    assert json.loads(cache.read_text())["tflops"] == peak


def test_dashboards_keep_validation_and_each_source_off_the_training_curve():
    train = {"kind": "train", "step": 100, "loss": 2.5, "lr": 1e-3, "spike": False}
    assert metric_tags(train) == {"loss": 2.5, "lr": 1e-3, "spike": False}
    assert metric_tags({"kind": "valid", "step": 100, "loss": 3.1}) == {"valid/loss": 3.1}
    code = {"kind": "valid", "step": 100, "loss": 4.2, "source": "code"}
    assert metric_tags(code) == {"valid/code/loss": 4.2}
    saved = {"kind": "checkpoint", "step": 100, "stall_s": 0.5, "path": "/x"}
    assert metric_tags(saved) == {"checkpoint/stall_s": 0.5}


def test_each_sources_validation_record_is_kept(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.write({"kind": "train", "step": 2, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.0})
    for source, loss in (("code", 3.1), ("web", 4.2), ("code", 3.0)):
        writer.write({"kind": "valid", "step": 2, "loss": loss, "source": source})
    writer.close()
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["kind"], r.get("source"), r["loss"]) for r in records] == [
        ("train", None, 4.0),
        ("valid", "code", 3.0),
        ("valid", "web", 4.2),
    ]
    assert plot_metrics(records, str(tmp_path / "plot.png"))


def test_resumed_steps_are_read_once_with_the_last_record_winning(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    for step, loss in ((1, 5.0), (2, 4.0), (2, 3.5), (3, 3.0)):
        writer.write({"kind": "train", "step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0})
    writer.write({"kind": "valid", "step": 2, "loss": 3.9})
    writer.close()
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["kind"], r["step"], r["loss"]) for r in records] == [
        ("train", 1, 5.0),
        ("train", 2, 3.5),
        ("valid", 2, 3.9),
        ("train", 3, 3.0),
    ]
    assert plot_metrics(records, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


PYTHON_BACKEND = """
import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend


class DeviceModule:
    # what a backend whose allocator is not torch's DeviceAllocator offers: its own counter
    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def max_memory_allocated(device=None):
        return 3 * 2**29


_setup_privateuseone_for_python_backend("neuron", backend_module=DeviceModule())
"""


def test_peak_memory_comes_from_the_device_module_where_torch_accelerator_has_none():
    from torch.utils import backend_registration

    if not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"):
        pytest.skip("this torch cannot register a Python device backend")
    script = PYTHON_BACKEND + (
        "from hlat_train.metrics import memory_gib\n"
        "device = torch.device('neuron', 0)\n"
        "try:\n"
        "    torch.accelerator.max_memory_allocated(device)\n"
        "    print('accelerator statistics')\n"
        "except (RuntimeError, NotImplementedError):\n"
        "    print('no accelerator statistics')\n"
        "print(memory_gib(device))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["no", "accelerator", "statistics", "1.5"]
