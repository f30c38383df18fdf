"""The CPU kernel's build, cache and failure handling (real compiler runs, no mocks)."""

import warnings

import pytest
import torch

from hlat_optim import AdamW, _native


def test_builds_once_into_the_cache_and_reuses_it(fresh_loader, monkeypatch):
    assert _native.load() is not None, _native.unavailable_reason()
    built = list(fresh_loader.glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(_native, "_tried", False)
    assert _native.load() is not None
    assert [p.stat().st_mtime_ns for p in fresh_loader.glob("*.so")] == [stamp]
    # only the library: no temporary build file left beside it
    assert [p.name for p in fresh_loader.iterdir()] == [built[0].name]


def test_a_failing_compiler_is_reported_and_auto_falls_back(fresh_loader, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a compiler that exits 1
    assert _native.load() is None
    assert "false failed (exit 1)" in _native.unavailable_reason()
    assert not list(fresh_loader.glob("*"))  # the failed build leaves nothing behind

    p = torch.nn.Parameter(torch.ones(10, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"impl='native'.*could not be built: .*false failed"):
        AdamW([p], impl="native").step()
    expected = p.detach().clone()
    with warnings.catch_warnings():
        # auto moves on to torch.compile, which uses $CXX as well here and so falls back to
        # the reference with a warning: either way the result is the reference's
        warnings.simplefilter("ignore", RuntimeWarning)
        AdamW([p], impl="auto").step()
    q = torch.nn.Parameter(expected)
    q.grad = torch.ones_like(q)
    AdamW([q], impl="reference").step()
    assert torch.equal(p.view(torch.int16), q.view(torch.int16))


def test_a_compiler_without_openmp_still_builds_a_working_kernel(
    fresh_loader, monkeypatch, tmp_path
):
    # A real compiler that rejects -fopenmp, as Apple clang does.
    wrapper = tmp_path / "cxx-without-openmp"
    wrapper.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && { echo "no -fopenmp" >&2; exit 1; }; done\n'
        'exec c++ "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    assert _native.load() is not None, _native.unavailable_reason()
    params = [torch.nn.Parameter(torch.randn(50_001).to(torch.bfloat16)) for _ in range(2)]
    expected = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, expected, strict=True):
        p.grad = torch.randn(p.shape).to(torch.bfloat16)
        q.grad = p.grad.clone()
    AdamW(params, impl="native").step()
    AdamW(expected, impl="reference").step()
    for p, q in zip(params, expected, strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))


def test_disabled_by_environment(fresh_loader, monkeypatch):
    monkeypatch.setenv("HLAT_OPTIM_NATIVE", "0")
    assert _native.load() is None
    assert _native.unavailable_reason() == "disabled by HLAT_OPTIM_NATIVE=0"


def test_extra_flags_from_the_environment_build_a_library_of_their_own(fresh_loader, monkeypatch):
    assert _native.load() is not None, _native.unavailable_reason()
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setenv("HLAT_OPTIM_CXXFLAGS", "-DHLAT_UNUSED_MACRO=1")
    assert _native.load() is not None, _native.unavailable_reason()
    assert len(list(fresh_loader.glob("*.so"))) == 2  # the flags are part of the cache key

    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setenv("HLAT_OPTIM_CXXFLAGS", "-fno-such-flag")
    assert _native.load() is None
    assert "-fno-such-flag" in _native.unavailable_reason()
