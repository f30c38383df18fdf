"""hlat-ckpt: sharded, atomic, async checkpoints with auto-resume on torch.distributed.checkpoint.

``torch.distributed.checkpoint`` is imported on the first save or load, and the Neuron backend
(:class:`NeuronCheckpointer`) on first use, so importing this package costs little more than
torch itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .checkpointer import Checkpointer, CheckpointError, CheckpointInfo, SaveStats
from .consolidate import consolidate
from .manifest import (
    MANIFEST_NAME,
    DamagedCheckpointError,
    IncompleteCheckpointError,
    Manifest,
    UnsupportedFormatError,
)
from .rng import RNGState

if TYPE_CHECKING:
    from .neuron import NeuronCheckpointer

__all__ = [
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "DamagedCheckpointError",
    "IncompleteCheckpointError",
    "Manifest",
    "NeuronCheckpointer",
    "RNGState",
    "SaveStats",
    "UnsupportedFormatError",
    "consolidate",
]
__version__ = "0.12.0"


def __getattr__(name: str) -> Any:
    if name == "NeuronCheckpointer":
        from .neuron import NeuronCheckpointer

        globals()[name] = NeuronCheckpointer
        return NeuronCheckpointer
    raise AttributeError(f"module 'hlat_ckpt' has no attribute {name!r}")
