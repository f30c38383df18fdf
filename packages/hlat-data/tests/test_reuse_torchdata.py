"""docs/reuse/torchdata_stateful_loader.py: hlat-data behind torchdata's StatefulDataLoader,
resumed through the data loader's own state_dict."""

import pytest
import torch

pytest.importorskip("torchdata.stateful_dataloader", reason="the example needs torchdata")


def test_stateful_dataloader_resumes_the_packed_batches_exactly(
    corpus, tokenizer_path, reuse_example
):
    example = reuse_example("torchdata_stateful_loader")
    loader = example.data_loader(str(corpus), tokenizer_path)
    first = example.take(loader, 3)
    assert first[0]["input_ids"].shape == (4, 64) and first[0]["input_ids"].dtype == torch.int64
    state = loader.state_dict()
    expected = example.take(loader, 4)

    resumed = example.data_loader(str(corpus), tokenizer_path)
    resumed.load_state_dict(state)
    again = example.take(resumed, 4)
    assert len(again) == 4
    for a, b in zip(expected, again, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    # not simply the start again
    assert not torch.equal(again[0]["input_ids"], first[0]["input_ids"])
