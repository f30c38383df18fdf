"""PyTorch adapters: batches as tensors, and the loader as an ``IterableDataset``.

Importing this module needs torch; ``import hlat_data`` does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from hlat_data.errors import DataError
from hlat_data.loader import PackedLoader
from hlat_data.packer import Batch


def to_torch(
    batch: Batch, device: torch.device | str | None = None, non_blocking: bool = False
) -> dict[str, torch.Tensor]:
    """The batch as int64 tensors keyed by field name (zero-copy on the CPU).

    ``model(**{k: v for k, v in t.items() if k != "labels"})`` fits
    ``hlat_model.Llama.forward(input_ids, position_ids, doc_lens)``.
    """
    out = {name: torch.from_numpy(value) for name, value in batch._asdict().items()}
    if device is not None:
        out = {k: v.to(device, non_blocking=non_blocking) for k, v in out.items()}
    return out


class TorchPackedDataset(IterableDataset):
    """A :class:`PackedLoader` seen as a torch ``IterableDataset`` of tensor dicts.

    Use it directly (``for batch in dataset``), or in a ``DataLoader(dataset,
    batch_size=None, num_workers=0)``: the loader already batches and runs its own
    tokenizer workers (``PackedLoader(num_workers=...)``), and its state lives in this
    process. In a torch worker process each worker would yield every batch of the loader and
    the state here would never advance, so iterating there raises :class:`DataError`.
    ``state_dict``/``load_state_dict`` pass through, so it is a checkpointable ``Stateful``.
    """

    def __init__(self, loader: PackedLoader, device: torch.device | str | None = None) -> None:
        self.loader = loader
        self.device = device

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            raise DataError(
                f"TorchPackedDataset is iterated in DataLoader worker {worker.id} of "
                f"{worker.num_workers}: every worker would yield the same batches and the "
                "loader's state in the main process would never advance; use "
                "DataLoader(dataset, batch_size=None, num_workers=0), and the loader's own "
                "num_workers= for tokenizer processes"
            )
        for batch in self.loader:
            yield to_torch(batch, self.device)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state (plain data, no tensors)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the loader from ``state``."""
        self.loader.load_state_dict(state)
