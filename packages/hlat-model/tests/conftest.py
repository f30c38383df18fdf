import contextlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def saved_for_backward():
    """A context manager that lists the tensors autograd saves for backward inside it."""

    @contextlib.contextmanager
    def record():
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved

    return record
