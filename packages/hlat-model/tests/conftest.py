import contextlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_and_many_threads():
    """A function giving ``fn()`` run with one thread and with at least two (torch's thread
    count restored after)."""

    def run(fn):
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = fn()
            torch.set_num_threads(max(2, threads))
            return one, fn()
        finally:
            torch.set_num_threads(threads)

    return run


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


@pytest.fixture
def traced_targets():
    """A function giving the operators of the graph that ``torch.compile`` traces from
    ``fn(*args)`` (dynamo's graph, before any backend compiles it)."""

    def trace(fn, *args) -> list[str]:
        targets: list[str] = []

        def record(graph_module, example_inputs):
            targets.extend(str(node.target) for node in graph_module.graph.nodes)
            return graph_module.forward

        torch._dynamo.reset()
        try:
            torch.compile(fn, backend=record, fullgraph=True, dynamic=False)(*args)
        finally:
            torch._dynamo.reset()
        return targets

    return trace


@pytest.fixture(params=["native", "composed"])
def kernels(request, monkeypatch):
    """Each test using it runs twice: with the fused CPU kernels of ``hlat_model._native``
    (which must build here) and with them turned off (torch's operators). Attention keeps
    its blocked kernel in both: the flash kernels are off (``test_blocked_attention.py``'s
    ``amx`` and ``flash`` fixtures turn them on for their own tests)."""
    from hlat_model import _native

    _native.reset()
    monkeypatch.setenv("HLAT_MODEL_FLASH_ATTENTION", "0")
    if request.param == "composed":
        monkeypatch.setenv("HLAT_MODEL_NATIVE", "0")
    else:
        monkeypatch.delenv("HLAT_MODEL_NATIVE", raising=False)
        assert _native.load() is not None, _native.unavailable_reason()
    yield request.param
    _native.reset()
