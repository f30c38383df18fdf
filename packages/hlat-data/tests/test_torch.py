from __future__ import annotations

import itertools

import pytest

from hlat_data import ArrowSource, DataError, PackedLoader

torch = pytest.importorskip("torch")


def test_torch_dataset_yields_int64_tensors_equal_to_the_numpy_batches_and_resumes(
    corpus, tokenizer
):
    from hlat_data.torch import TorchPackedDataset

    def loader():
        return PackedLoader(ArrowSource(corpus), tokenizer, 32, 2, seed=1, block_size=4)

    expected = list(itertools.islice(loader(), 6))
    dataset = TorchPackedDataset(loader())
    got = list(itertools.islice(dataset, 3))
    resumed = TorchPackedDataset(loader())
    resumed.load_state_dict(dataset.state_dict())
    got += list(itertools.islice(resumed, 3))
    for batch, tensors in zip(expected, got, strict=True):
        for name in batch._fields:
            assert tensors[name].dtype == torch.int64
            assert torch.equal(tensors[name], torch.from_numpy(getattr(batch, name)))


def test_tensors_feed_a_torch_data_loader_without_rebatching(corpus, tokenizer):
    from hlat_data.torch import TorchPackedDataset

    dataset = TorchPackedDataset(PackedLoader(ArrowSource(corpus), tokenizer, 32, 2, block_size=4))
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=None)))
    assert batch["input_ids"].shape == (2, 32)
    assert int(batch["doc_lens"].sum()) == 64


def test_torch_worker_processes_are_refused_naming_the_fix(corpus, tokenizer):
    from hlat_data.torch import TorchPackedDataset

    dataset = TorchPackedDataset(PackedLoader(ArrowSource(corpus), tokenizer, 32, 2, block_size=4))
    # Note: a spawned worker; one forked from a test process that has run other tests
    # inherits their threads' state (a lock held at the fork), which can crash it
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=1, multiprocessing_context="spawn"
    )
    with pytest.raises(DataError, match=r"DataLoader worker 0 of 1: .*num_workers=0"):
        next(iter(loader))
    assert dataset.state_dict()["batches"] == 0
    assert next(iter(torch.utils.data.DataLoader(dataset, batch_size=None)))["input_ids"].shape == (
        2,
        32,
    )
