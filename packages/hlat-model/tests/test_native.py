"""Building and loading the fused CPU kernels: the cache, builds for other CPU levels, and
a model that still trains where they cannot be built."""

from __future__ import annotations

import platform

import pytest
import torch

import hlat_model.attention as attention_module
from hlat_model import Llama, LlamaConfig, _native, fused_cpu_kernels_reason
from hlat_model.attention import (
    AttentionMask,
    blocked_causal_attention,
    fp32_flash_attention_reason,
)
from hlat_model.model import RMSNorm, _HeadsWithRope, _SwiGLUFunction, rope_cos_sin


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache directory and no library loaded yet (restored afterwards)."""
    monkeypatch.setenv("HLAT_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HLAT_MODEL_NATIVE", raising=False)
    monkeypatch.delenv("HLAT_MODEL_CXXFLAGS", raising=False)
    _native.reset()
    yield tmp_path / "cache"
    _native.reset()


def _outputs(dtype: torch.dtype, wrap=lambda g: g) -> list[torch.Tensor]:
    """Every kernel's output and gradients on fixed inputs (the kernels that are loaded),
    each output's gradient passed through ``wrap``."""
    torch.manual_seed(0)
    x = (torch.randn(6, 40, 72) * 2).to(dtype).requires_grad_()
    norm = RMSNorm(72).to(dtype)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    out = norm(x)
    out.backward(wrap(torch.randn_like(out)))
    gate_up = (torch.randn(6, 40, 2 * 50) * 3).to(dtype).requires_grad_()
    h = _SwiGLUFunction.apply(gate_up, True)
    h.backward(wrap(torch.randn_like(h)))
    qkv = torch.randn(2, 12, 2, 4, 16).to(dtype).requires_grad_()
    cos, sin = rope_cos_sin(torch.arange(12)[None], 16, 10000.0)
    q, k, v = _HeadsWithRope.apply(qkv, cos, sin)
    torch.autograd.backward((q, k, v), tuple(wrap(torch.randn_like(t)) for t in (q, k, v)))
    mixed = (torch.randn(6, 40, 2 * 50) * 3).to(dtype).requires_grad_()
    h2 = _SwiGLUFunction.apply(mixed, True, True)  # gate and up interleaved
    h2.backward(wrap(torch.randn_like(h2)))
    q2, k2, v2 = (torch.randn(2, 3, 300, 16).to(dtype).requires_grad_() for _ in range(3))
    attended = blocked_causal_attention(q2, k2, v2)  # the softmax kernels, the bf16 sums
    attended.backward(wrap(torch.randn_like(attended)))
    return [
        *(out, x.grad, norm.weight.grad, h, gate_up.grad, q, k, v, qkv.grad, h2, mixed.grad),
        *(attended, q2.grad, k2.grad, v2.grad),
    ]


def test_built_once_per_machine_type_and_reused(fresh):
    assert _native.load() is not None, _native.unavailable_reason()
    built = sorted(fresh.glob("fused_cpu_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    _native.reset()
    assert _native.load() is not None
    assert sorted(fresh.glob("fused_cpu_*.so")) == built
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not built again
    assert fused_cpu_kernels_reason() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gradient_from_a_functional_collective_reaches_the_kernels_as_its_values(fresh, dtype):
    """Under sequence parallelism a gradient can arrive as an ``AsyncCollectiveTensor``
    (a wrapper whose own pointer holds no values): the kernels read what it wraps."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    assert _native.load() is not None, _native.unavailable_reason()
    plain = _outputs(dtype)
    wrapped = _outputs(dtype, AsyncCollectiveTensor)
    for a, b in zip(plain, wrapped, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels"
)
@pytest.mark.parametrize("level", ["x86-64-v3", "x86-64"])  # AVX2 + FMA; SSE2 only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_build_for_an_older_cpu_gives_the_same_numbers(fresh, monkeypatch, level, dtype):
    """A library built for AVX2-only CPUs (8-lane vectors) or for any x86-64 CPU, as a
    mixed cluster would build it (``HLAT_MODEL_CXXFLAGS``), against this CPU's own build:
    the same numbers up to fused multiply-adds (one rounding of the dtype)."""
    assert _native.load() is not None, _native.unavailable_reason()
    native = _outputs(dtype)
    monkeypatch.setenv("HLAT_MODEL_CXXFLAGS", f"-march={level}")
    _native.reset()
    assert _native.load() is not None, _native.unavailable_reason()
    assert len(list(fresh.glob("fused_cpu_*.so"))) == 2  # another key, another library
    older = _outputs(dtype)
    unit = 2**-7 if dtype == torch.bfloat16 else 1e-5
    for a, b in zip(older, native, strict=True):
        torch.testing.assert_close(a, b, rtol=unit, atol=unit * b.abs().max().item())


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _attention_run(q, k, v, grad, dtype=None, mask=None) -> list[torch.Tensor]:
    """Outputs and gradients of causal attention, or of ``auto``'s attention with ``mask`` (the
    flash kernel with packed documents' first keys where it runs, else the blocked kernel)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = (
        blocked_causal_attention(*leaves)
        if mask is None
        else attention_module.attention(*leaves, mask)
    )
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.skipif(
    not {"avx2", "fma"} <= _cpu_flags(), reason="runs a build for AVX2 with FMA (x86 Linux)"
)
@pytest.mark.parametrize(
    "shape, kv_heads, scale, documents",
    [((2, 3, 96, 32), 3, 1.0, None), ((1, 4, 320, 64), 2, 6.0, None),
     ((2, 2, 320, 32), 1, 1.0, [[1, 40, 99, 180], [150, 100]])],
    ids=["small", "grouped-peaked", "grouped-documents"],
)  # fmt: skip
def test_the_fp32_flash_kernel_built_for_avx2_matches_float64(
    fresh, monkeypatch, shape, kv_heads, scale, documents
):
    """Built for AVX2-only CPUs (``-march=x86-64-v3``: 8-lane vectors, its own exponential and
    transposes), the fp32 flash attention runs and its output and gradients are within 1e-5
    of float64 (norm-wise) and of this CPU's own build (fused multiply-adds and sums in
    another order), with grouped key and value heads and packed documents too."""
    monkeypatch.delenv("HLAT_MODEL_FLASH_ATTENTION", raising=False)
    generator = torch.Generator().manual_seed(1)
    q, grad = (torch.randn(shape, generator=generator) for _ in range(2))
    k, v = (torch.randn(shape[0], kv_heads, *shape[2:], generator=generator) for _ in range(2))
    q = q * scale
    assert _native.load() is not None, _native.unavailable_reason()
    mask = None
    if documents is not None:
        lens = torch.tensor([row + [0] * (4 - len(row)) for row in documents])
        mask = AttentionMask.build(lens, shape[2], "auto", torch.device("cpu"))
        assert mask.takes_flash
    own = _attention_run(q, k, v, grad, mask=mask)
    monkeypatch.setenv("HLAT_MODEL_CXXFLAGS", "-march=x86-64-v3")
    _native.reset()
    assert _native.load() is not None, _native.unavailable_reason()
    assert fp32_flash_attention_reason() is None
    assert attention_module._on_flash_kernel(q, k, v)
    avx2 = _attention_run(q, k, v, grad, mask=mask)
    # the blocked kernel
    reference = _attention_run(q, k, v, grad, torch.float64, mask=mask)
    for name, mine, theirs, exact in zip(
        ("out", "dq", "dk", "dv"), avx2, own, reference, strict=True
    ):
        error = ((mine.double() - exact).norm() / exact.norm()).item()
        assert error < 1e-5, (name, error)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


def _trains(config: LlamaConfig) -> None:
    torch.manual_seed(0)
    model = Llama(config)
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    assert loss.isfinite() and all(p.grad is not None for p in model.parameters())


def test_without_a_compiler_the_model_runs_on_torch_operators(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CXX", raising=False)
    assert _native.load() is None
    assert fused_cpu_kernels_reason() == "no C++ compiler found (set CXX)"
    _trains(LlamaConfig.preset("tiny"))


def test_a_failed_build_says_why_and_the_model_still_runs(fresh, monkeypatch):
    monkeypatch.setenv("HLAT_MODEL_CXXFLAGS", "-fno-such-flag-anywhere")
    assert _native.load() is None
    why = fused_cpu_kernels_reason()
    assert why is not None and "no-such-flag-anywhere" in why
    assert not list(fresh.glob("*.so"))  # no half-built library left behind
    _trains(LlamaConfig.preset("tiny"))


def test_turned_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("HLAT_MODEL_NATIVE", "0")
    assert fused_cpu_kernels_reason() == "turned off by HLAT_MODEL_NATIVE=0"
