"""Throughput and MFU, and where metrics go: JSONL, TensorBoard, a progress bar, a plot."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

# Dense bf16 peak TFLOP/s per device (the unit one process drives), from vendor data sheets.
PEAK_TFLOPS: dict[str, float] = {
    # trn1: "Two NeuronCore-v2 delivering ... 190 FP16/BF16/cFP8/TF32 TFLOPS" per Trainium
    # chip (AWS Neuron docs, Trainium architecture); one process drives one NeuronCore-v2.
    "trainium-neuroncore-v2": 95.0,
    # trn2: "Eight NeuronCore-v3 that collectively deliver ... 667 BF16/FP16/TF32 TFLOPS" per
    # Trainium2 chip (AWS Neuron docs, Trainium2 architecture): per physical NeuronCore.
    "trainium2-neuroncore-v3": 667.0 / 8,
    # trn3: "Eight NeuronCore-v4 cores that collectively deliver ... 671 BF16/FP16/TF32
    # TFLOPS" per Trainium3 chip (AWS Neuron docs, Trainium3 architecture).
    "trainium3-neuroncore-v4": 671.0 / 8,
    "h200": 989.0,  # SXM, same tensor cores as H100 SXM
    "h100": 989.0,  # SXM; PCIe parts are lower, pass logging.peak_tflops
    "a100": 312.0,
}

_NEURON_CORES = {"trn2": "trainium2-neuroncore-v3", "trn3": "trainium3-neuroncore-v4"}
DEFAULT_LOGICAL_NEURONCORES = 2
"""Physical NeuronCores per logical one on trn2/trn3 (``NEURON_LOGICAL_NC_CONFIG``), the
unit one TorchNeuron process drives; 2 is the Neuron runtime's default there."""


def device_name(device: torch.device) -> str:
    """The device's model name from the ``get_device_name`` of its torch module (that of
    CUDA, XPU, TorchNeuron...); the device type where the module has none."""
    import torch

    module = getattr(torch, device.type, None)
    get_name = getattr(module, "get_device_name", None)
    if device.type != "cpu" and callable(get_name):
        try:
            return str(get_name(device))
        except Exception:  # a plugin may not implement it for every index
            pass
    return device.type


def table_peak(
    device_type: str, name: str, backend: str = "torch", instance: str | None = None
) -> tuple[float, str] | None:
    """(peak TFLOP/s, what it is) from :data:`PEAK_TFLOPS`, or None where the table has no
    entry (pure: the caller supplies what it found).

    Trainium is recognised by the backend (``neuron``: trn1 NeuronCore-v2) or by the
    ``neuron`` device with the instance type (trn2/trn3), where one process drives a
    logical NeuronCore of ``NEURON_LOGICAL_NC_CONFIG`` physical ones.
    """
    if backend == "neuron":
        return PEAK_TFLOPS["trainium-neuroncore-v2"], "Trainium NeuronCore-v2 (table)"
    if device_type == "neuron":
        generation = (instance or "").split(".")[0]
        key = _NEURON_CORES.get(generation)
        if key is None:
            return None
        try:
            lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", DEFAULT_LOGICAL_NEURONCORES))
        except ValueError:
            lnc = DEFAULT_LOGICAL_NEURONCORES
        return PEAK_TFLOPS[key] * lnc, f"{generation} logical NeuronCore of {lnc} {key} (table)"
    lowered = name.lower()
    for model in ("h200", "h100", "a100"):
        if model in lowered:
            return PEAK_TFLOPS[model], f"{model.upper()} (table)"
    return None


def device_peak_tflops(
    device: torch.device, backend: str = "torch", cache: str | None = None
) -> tuple[float, str]:
    """(peak TFLOP/s of one device, what it is) for MFU.

    Trainium and the GPUs of :data:`PEAK_TFLOPS` come from the table; on a CPU, or a device
    not in the table, the peak is *measured* with a short fp32 matmul (so MFU reads as a
    fraction of what this machine's matmul reaches, not of a data-sheet number). With
    ``cache`` (a JSON file path) a measurement is saved there and reused by later calls on
    the same host, device and thread count: a restarted run keeps its first measurement
    instead of paying for another one at every start.
    """
    import torch

    from hlat_parallel.device import instance_type

    name = device_name(device)
    known = table_peak(device.type, name, backend, instance_type())
    if known is not None:
        return known
    source = f"{name} (measured fp32 matmul)"
    key = {"host": socket.gethostname(), "device": name, "threads": torch.get_num_threads()}
    if cache is not None:
        try:
            with open(cache) as f:
                saved = json.load(f)
            if saved.get("key") == key and saved.get("tflops", 0) > 0:
                return float(saved["tflops"]), f"{source}, saved in {cache}"
        except (OSError, ValueError, AttributeError):
            pass  # no measurement yet, or an unreadable one: measure again
    peak = measure_matmul_tflops(device)
    if cache is not None:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
            tmp = f"{cache}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"key": key, "tflops": peak}, f)
            os.replace(tmp, cache)
    return peak, source


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure_matmul_tflops(device: torch.device, size: int = 1024, seconds: float = 0.3) -> float:
    """The fp32 matmul rate this device reaches now, in TFLOP/s (best of repeated timings)."""
    import torch

    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.mm(a, b)  # warm-up: thread pool and kernels
    _synchronize(device)
    best = math.inf
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == math.inf:
        start = time.perf_counter()
        torch.mm(a, b)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def memory_gib(device: torch.device) -> float:
    """Peak memory allocated on an accelerator, or the resident memory of this process on a
    CPU, in GiB (NaN where the accelerator keeps no statistics).

    The accelerator's figure is ``torch.accelerator``'s, which torch gives only for backends
    whose allocator is its ``DeviceAllocator``; for another allocator it raises, and the
    figure is then the device module's own ``max_memory_allocated`` (``torch.neuron``'s,
    ``torch.cuda``'s...) where it has one."""
    if device.type != "cpu":
        import torch

        try:
            return torch.accelerator.max_memory_allocated(device) / 2**30
        except (RuntimeError, NotImplementedError):
            pass
        try:
            own = getattr(torch.get_device_module(device), "max_memory_allocated", None)
            if callable(own):
                return float(own(device)) / 2**30
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            pass
        return math.nan
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return 0.0


class MetricsWriter:
    """Writes one record per logged step to ``metrics.jsonl`` and, when asked and installed,
    to TensorBoard. Only rank 0 should create one."""

    def __init__(
        self,
        out_dir: str,
        jsonl: bool = True,
        tensorboard: bool = False,
        sinks: list[Any] | None = None,
    ) -> None:
        self._sinks = list(sinks or [])  # more destinations: objects with log() and close()
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._file = open(self.path, "a") if jsonl else None  # noqa: SIM115 - closed in close()
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(out_dir, "tb"))
            except Exception as e:  # tensorboard missing or broken: keep training
                print(
                    f"hlat-train: TensorBoard disabled ({e}); pip install tensorboard",
                    file=sys.stderr,
                )

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must hold ``step``); flushed at once so a killed run keeps it."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for tag, value in metric_tags(record).items():
                self._tb.add_scalar(tag, value, record["step"])
        for sink in self._sinks:
            sink.log(record)

    def close(self) -> None:
        """Flush and close."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def metric_tags(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record under the names dashboards show: a ``train`` record's under
    their own names, other kinds' under ``<kind>/`` and, for a held-out set of a mixture
    source, ``<kind>/<source>/`` (so validation losses never land on the training curve,
    nor one source's on another's)."""
    kind = record.get("kind", "train")
    prefix = "" if kind == "train" else f"{kind}/"
    if record.get("source"):
        prefix += f"{record['source']}/"
    return {
        prefix + key: value
        for key, value in record.items()
        if key not in ("step", "kind") and isinstance(value, int | float)
    }


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; for a record logged twice (a resumed run repeats
    the steps after its checkpoint), the last one wins (records are told apart by kind, step
    and held-out source). Sorted by step."""
    by_step: dict[tuple[str, int, str], dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                record = json.loads(line)
                key = (record.get("kind", "train"), record["step"], record.get("source", ""))
                by_step[key] = record
    return sorted(by_step.values(), key=lambda r: (r["step"], r.get("kind", "train")))


class Progress:
    """A progress bar with ETA (tqdm when installed, else a line every few seconds).

    ``log``: where :meth:`write` sends its lines when the bar is off (the trainer's log).
    """

    def __init__(
        self, total: int, initial: int, enabled: bool, log: Callable[[str], None] | None = None
    ) -> None:
        self._bar: Any = None
        self._enabled = enabled
        self._log = log
        self._total = total
        self._last_print = 0.0
        self._start = time.perf_counter()
        self._initial = initial
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        except ImportError:
            self._bar = None

    def update(self, step: int, postfix: str) -> None:
        """Advance to ``step`` and show ``postfix`` (loss, lr, ...)."""
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(postfix, refresh=False)
            return
        now = time.perf_counter()
        if now - self._last_print > 5 or step == self._total:
            done = step - self._initial
            eta = (now - self._start) / max(done, 1) * (self._total - step)
            print(f"step {step}/{self._total} {postfix} eta {eta:.0f}s", flush=True)
            self._last_print = now

    def write(self, text: str) -> None:
        """Print a line without breaking the bar; with the bar off, give it to ``log``."""
        if self._bar is not None:
            self._bar.write(text)
        elif self._enabled:
            print(text, flush=True)
        elif self._log is not None:
            self._log(text)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()


def plot_metrics(records: list[dict[str, Any]], path: str) -> bool:
    """A PNG with loss (train and validation), learning rate and gradient norm per step.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [r for r in records if r.get("kind", "train") == "train"]
    valid = [r for r in records if r.get("kind") == "valid"]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    for source in dict.fromkeys(r.get("source", "") for r in valid):
        points = [r for r in valid if r.get("source", "") == source]
        label = f"valid ({source})" if source else "valid"
        axes[0].plot([r["step"] for r in points], [r["loss"] for r in points], "o-", label=label)
    axes[0].set_ylabel("loss")
    axes[0].legend()
    axes[1].plot([r["step"] for r in train], [r["lr"] for r in train])
    axes[1].set_ylabel("learning rate")
    axes[2].plot([r["step"] for r in train], [r["grad_norm"] for r in train])
    axes[2].set_ylabel("grad norm")
    axes[2].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
