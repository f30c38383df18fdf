"""hlat-ckpt: sharded, atomic, async checkpoints with auto-resume on torch.distributed.checkpoint."""

from .checkpointer import Checkpointer, CheckpointError, CheckpointInfo
from .consolidate import consolidate
from .manifest import MANIFEST_NAME, IncompleteCheckpointError, Manifest
from .neuron import NeuronCheckpointer
from .rng import RNGState

__all__ = [
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "IncompleteCheckpointError",
    "Manifest",
    "NeuronCheckpointer",
    "RNGState",
    "consolidate",
]
__version__ = "0.1.0"
