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


FLASH_KERNELS = ("bf16-amx", "bf16-avx512bf16", "fp32")
"""The fused kernels' flash attention kernels: bf16 on AMX tiles, bf16 by AVX512-BF16 dot
products, fp32 on AVX-512 or AVX2 (as built for this CPU)."""


@pytest.fixture
def flash_on(monkeypatch):
    """A function turning on one of :data:`FLASH_KERNELS` (skipping the test where it cannot
    run, saying why) and returning its dtype. ``bf16-avx512bf16`` turns the AMX tiles off
    (``HLAT_MODEL_AMX_ATTENTION=0``), so on CPUs with AMX it runs the dot products too."""
    from hlat_model.attention import (
        amx_attention_reason,
        bf16_flash_attention_reason,
        fp32_flash_attention_reason,
    )

    def turn_on(kernel: str) -> torch.dtype:
        monkeypatch.delenv("HLAT_MODEL_FLASH_ATTENTION", raising=False)
        monkeypatch.delenv("HLAT_MODEL_AMX_ATTENTION", raising=False)
        if kernel == "bf16-avx512bf16":
            monkeypatch.setenv("HLAT_MODEL_AMX_ATTENTION", "0")
        reason = {
            "bf16-amx": amx_attention_reason,
            "bf16-avx512bf16": bf16_flash_attention_reason,
            "fp32": fp32_flash_attention_reason,
        }[kernel]()
        if reason is not None:
            pytest.skip(f"no {kernel} flash attention here: {reason}")
        return torch.float32 if kernel == "fp32" else torch.bfloat16

    return turn_on


@pytest.fixture(params=FLASH_KERNELS)
def flash(request, flash_on):
    """Each flash kernel on (skipped where it cannot run), its dtype the fixture's value."""
    return flash_on(request.param)


@pytest.fixture(params=FLASH_KERNELS[:2])
def bf16_flash(request, flash_on):
    """The bf16 flash kernel on, on AMX tiles and by dot products (each skipped where it
    cannot run); the value is the kernel's name."""
    flash_on(request.param)
    return request.param


@pytest.fixture(params=["native", "composed"])
def kernels(request, monkeypatch):
    """Each test using it runs twice: with the fused CPU kernels of ``hlat_model._native``
    (which must build here) and with them turned off (torch's operators). Attention keeps
    its blocked kernel in both: the flash kernels are off (``flash_on`` turns one on for
    the tests of its kernel)."""
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
