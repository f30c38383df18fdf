"""The device a rank computes on, and what follows from it, for every device torch knows.

One code path serves CPUs, GPUs and Trainium trn2/trn3 (TorchNeuron registers Trainium as
torch's ``neuron`` device): the device comes from ``torch.accelerator`` and everything else
(process-group backend, compile backend, pinned host memory) follows from its type. Nothing
here branches on "cuda".

Which Trainium generation takes which path, stated once:

- **trn2, trn3**: the native path, ``backend="torch"`` on device ``neuron`` (TorchNeuron,
  the ``torch-neuronx`` package of Neuron 2.33+, public beta): DTensor TP/SP, FSDP2, DCP.
- **trn1**: the legacy path, ``backend="neuron"``: PyTorch/XLA with NeuronX Distributed
  (TorchNeuron does not run on trn1; NxD Training was archived in Neuron 2.32, so trn1
  stays on the last releases that ship it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

DMI_PRODUCT_NAME = "/sys/devices/virtual/dmi/id/product_name"
"""Where Linux exposes the machine's product name; on EC2 it is the instance type."""

INSTALL_HINTS: dict[str, str] = {
    "cuda": (
        "a CUDA build of torch (for nox: HLAT_TORCH='torch==2.13.0 --index-url "
        "https://download.pytorch.org/whl/cu128')"
    ),
    "neuron": (
        "TorchNeuron on a trn2 or trn3 instance: the torch-neuronx release matching this torch "
        f"(pip install 'torch-neuronx=={'.'.join(torch.__version__.split('.')[:2])}.*' "
        "--extra-index-url https://pip.repos.neuron.amazonaws.com); on trn1 use "
        "parallel.backend = 'neuron' (NeuronX Distributed) instead"
    ),
    "xpu": "an XPU build of torch",
    "mps": "a macOS build of torch on Apple silicon",
}

PIN_MEMORY_DEVICES = frozenset({"cuda", "xpu", "neuron"})
"""Device types whose host-to-device copies from page-locked memory run asynchronously.

Note: a copy from pageable memory makes the host wait for the device on CUDA (the driver
stages it synchronously), which would put a synchronisation into every training step."""


class DeviceError(ValueError):
    """A device that cannot be used here; the message says what to install."""


def _hint(device_type: str) -> str:
    return INSTALL_HINTS.get(device_type, f"a torch build or plugin for {device_type!r}")


def accelerator() -> torch.device | None:
    """The accelerator torch reports (``torch.accelerator``), or None on a CPU-only host.

    Note: a device type registered without its runtime module (a half-installed plugin)
    makes ``torch.accelerator`` raise; that counts as no accelerator, so the error the user
    sees names the device and what to install.
    """
    try:
        return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    except RuntimeError:
        return None


def check_device(spec: str) -> None:
    """Raise :class:`DeviceError` unless ``spec`` (``"auto"``, ``"cpu"``, ``"cuda"``,
    ``"neuron"``, ``"cuda:1"``, any other device torch knows) can be computed on here.

    Pure inspection: creates no tensor and no process group.
    """
    if spec == "auto":
        return
    try:
        device = torch.device(spec)
    except RuntimeError:
        name = spec.split(":")[0]
        raise DeviceError(
            f"device {spec!r}: torch {torch.__version__} has no device of that type; "
            f"install {_hint(name)}"
        ) from None
    if device.type == "cpu":
        return
    if device.type == "meta":
        raise DeviceError("device 'meta' holds no data; name a device to compute on, or 'auto'")
    found = accelerator()
    if found is None or found.type != device.type:
        have = f"the accelerator here is {found.type!r}" if found else "no accelerator is visible"
        raise DeviceError(
            f"device {spec!r} is not available: {have}; install {_hint(device.type)}, "
            "or use 'auto' or 'cpu'"
        )
    count = torch.accelerator.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(f"device {spec!r}: only {count} {device.type} devices are visible")


def resolve_device(spec: str = "auto", local_rank: int = 0) -> torch.device:
    """The device this rank computes on, made current for its type.

    ``auto`` is the accelerator torch reports, else the CPU. An accelerator without an index
    gets ``local_rank`` modulo the visible devices (one device per local process, as
    torchrun launches them).
    """
    check_device(spec)
    if spec == "auto":
        found = accelerator()
        device = found if found is not None else torch.device("cpu")
    else:
        device = torch.device(spec)
    if device.type == "cpu":
        return torch.device("cpu")
    index = device.index
    if index is None:
        index = local_rank % max(torch.accelerator.device_count(), 1)
    torch.accelerator.set_device_index(index)
    return torch.device(device.type, index)


def dist_backend_for(device: torch.device, requested: str = "auto") -> str:
    """The process-group backend for ``device``: ``requested``, or torch's default for the
    device type (``gloo`` on CPU, ``nccl`` on CUDA, ``neuron`` where TorchNeuron registers
    it)."""
    if requested != "auto":
        return requested
    try:
        return str(dist.get_default_backend_for_device(device))
    except (RuntimeError, ValueError) as error:
        raise DeviceError(
            f"torch has no default process-group backend for device type {device.type!r} "
            f"({error}); set parallel.dist_backend explicitly"
        ) from None


def compile_backend_for(device: torch.device) -> str:
    """The ``torch.compile`` backend for ``device``: TorchNeuron's ``neuron`` on Trainium,
    inductor elsewhere."""
    return "neuron" if device.type == "neuron" else "inductor"


def pins_memory(device: torch.device) -> bool:
    """Whether host buffers bound for ``device`` should be page-locked (see
    :data:`PIN_MEMORY_DEVICES`)."""
    return device.type in PIN_MEMORY_DEVICES and accelerator() is not None


def instance_type(path: str = DMI_PRODUCT_NAME) -> str | None:
    """The EC2 instance type (``trn1.32xlarge``), read from the DMI product name; None where
    the file is missing or empty."""
    try:
        with open(path) as f:
            name = f.read().strip()
    except OSError:
        return None
    return name or None


def _nxd_importable() -> bool:
    try:
        import neuronx_distributed  # noqa: F401
        import torch_xla  # noqa: F401
    except Exception:  # the PyPI placeholders raise on import, not only ImportError
        return False
    return True


def _trainium_generation(instance: str | None) -> str | None:
    """The Trainium generation (``trn1``, ``trn2``, ...) of an EC2 instance type, from its
    family (``trn1n.32xlarge`` -> ``trn1``, ``trn2u.48xlarge`` -> ``trn2``); None for any
    other instance or an unknown one."""
    found = re.fullmatch(r"(trn\d+)[a-z]*", (instance or "").split(".")[0])
    return found.group(1) if found else None


@dataclass(frozen=True)
class BackendChoice:
    """What ``backend="auto"`` chose, and why (for the log)."""

    backend: str
    reason: str


def choose_backend(
    device_type: str | None, nxd_available: bool, instance: str | None = None
) -> BackendChoice:
    """The parallel backend for ``backend="auto"`` (pure: every input is given).

    ``device_type`` is the device the run will compute on: the one asked for, or with
    ``device="auto"`` the accelerator ``torch.accelerator`` reports (None where it reports
    none); ``nxd_available`` whether NeuronX Distributed and torch-xla import; ``instance``
    the EC2 instance type where known; its family names the Trainium generation (``trn1``
    and ``trn1n`` are trn1, ``trn2`` and ``trn2u`` trn2). A ``neuron`` device means
    TorchNeuron, whose path is the native one even where NxD also imports. ``cpu``, which
    only an explicit ``device="cpu"`` gives, is the native path on the CPU, whatever the
    instance and whether NxD imports.
    """
    generation = _trainium_generation(instance)
    if device_type == "neuron":
        return BackendChoice(
            "torch", "the neuron device is registered (TorchNeuron): native path for trn2/trn3"
        )
    if device_type == "cpu":
        return BackendChoice("torch", "native path on cpu (DTensor, FSDP2), as device 'cpu' asks")
    if generation == "trn1":
        if not nxd_available:
            raise DeviceError(
                f"this is a {instance} instance, whose path is the legacy one (PyTorch/XLA with "
                "NeuronX Distributed), but neuronx_distributed or torch_xla does not import; "
                "install them from the Neuron package repository (pip install "
                "neuronx-distributed torch-neuronx --extra-index-url "
                "https://pip.repos.neuron.amazonaws.com)"
            )
        return BackendChoice("neuron", f"{instance}: legacy NeuronX Distributed path for trn1")
    if generation in ("trn2", "trn3") and device_type != "neuron":
        raise DeviceError(
            f"this is a {instance} instance, whose path is the native one on the neuron device, "
            f"but torch does not know that device; install {_hint('neuron')}"
        )
    if nxd_available and device_type is None:
        return BackendChoice("neuron", "NeuronX Distributed and torch-xla import: legacy path")
    where = device_type or "cpu"
    return BackendChoice("torch", f"native path on {where} (DTensor, FSDP2)")


def auto_backend(device_spec: str = "auto") -> BackendChoice:
    """:func:`choose_backend` for this machine (reads the instance type, tries the NxD
    import only for ``device="auto"`` where no accelerator is registered)."""
    check_device(device_spec)
    if device_spec == "auto":
        found = accelerator()
        device_type = found.type if found is not None else None
    else:
        device_type = torch.device(device_spec).type
    nxd = device_type is None and _nxd_importable()
    return choose_backend(device_type, nxd, instance_type())
