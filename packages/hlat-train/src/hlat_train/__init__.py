"""hlat-train: the HLAT pre-training loop and the ``hlat-train`` command.

>>> from hlat_train import TrainConfig, Trainer
>>> config = TrainConfig.preset("tiny-demo", ["--optim.lr=1e-3"])
"""

from hlat_train.config import ConfigError, TrainConfig, preset_names
from hlat_train.export import export_hf
from hlat_train.metrics import PEAK_TFLOPS, read_metrics
from hlat_train.spike import SpikeGuard
from hlat_train.trainer import Trainer
from hlat_train.validation import validate

__version__ = "0.1.0"

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
