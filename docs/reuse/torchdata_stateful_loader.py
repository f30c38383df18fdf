"""hlat-data behind torchdata's ``StatefulDataLoader``: packed, tokenized batches as tensors,
and a resume through the data loader's own ``state_dict``.

    pip install hlat-data torchdata
    python docs/reuse/torchdata_stateful_loader.py CORPUS.arrow TOKENIZER.model

``TorchPackedDataset`` is an ``IterableDataset`` with ``state_dict``/``load_state_dict``, so
``StatefulDataLoader`` saves and restores the loader's cursor with its own state. The loader
batches and tokenizes itself: give ``batch_size=None``, and keep ``num_workers=0`` (hlat-data
runs its own tokenizer workers with ``PackedLoader(num_workers=...)``).
"""

from __future__ import annotations

import sys
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from hlat_data import ArrowSource, PackedLoader, Tokenizer
from hlat_data.torch import TorchPackedDataset


def data_loader(corpus: str, tokenizer: str) -> StatefulDataLoader:
    packed = PackedLoader(
        ArrowSource([corpus]), Tokenizer.from_file(tokenizer), seq_len=64, micro_batch_size=4
    )
    return StatefulDataLoader(TorchPackedDataset(packed), batch_size=None, num_workers=0)


def take(loader: StatefulDataLoader, n: int) -> list[dict[str, Any]]:
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == n:
            break
    return batches


if __name__ == "__main__":
    corpus, tokenizer = sys.argv[1], sys.argv[2]
    loader = data_loader(corpus, tokenizer)
    take(loader, 3)
    state = loader.state_dict()  # a checkpoint would save this
    expected = take(loader, 3)
    resumed = data_loader(corpus, tokenizer)
    resumed.load_state_dict(state)
    again = take(resumed, 3)
    same = all(
        (a["input_ids"] == b["input_ids"]).all() for a, b in zip(expected, again, strict=True)
    )
    print("resumed batches equal:", same)
