"""hlat-train: the HLAT pre-training loop and the ``hlat-train`` command.

>>> from hlat_train import TrainConfig, Trainer
>>> config = TrainConfig.preset("tiny-demo", ["--optim.lr=1e-3"])

Only the config is imported with the package; the trainer (torch and the other hlat
packages), metrics, export and validation load on first use, so commands that do not train
(``presets``, ``print-config``, ``preflight``) start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hlat_train.config import ConfigError, TrainConfig, preset_names

if TYPE_CHECKING:
    from hlat_train.export import export_hf
    from hlat_train.metrics import PEAK_TFLOPS, read_metrics
    from hlat_train.spike import SpikeGuard
    from hlat_train.trainer import Trainer
    from hlat_train.validation import validate

__version__ = "0.28.8"

_LAZY = {
    "PEAK_TFLOPS": "hlat_train.metrics",
    "SpikeGuard": "hlat_train.spike",
    "Trainer": "hlat_train.trainer",
    "export_hf": "hlat_train.export",
    "read_metrics": "hlat_train.metrics",
    "validate": "hlat_train.validation",
}

__all__ = [
    "PEAK_TFLOPS",
    "ConfigError",
    "SpikeGuard",
    "TrainConfig",
    "Trainer",
    "export_hf",
    "preset_names",
    "read_metrics",
    "validate",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hlat_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
