"""Fixtures that point the CPU kernel's loader at a fresh build."""

import platform

import pytest

from hlat_optim import _native


def _forget_kernel(monkeypatch):
    # monkeypatch puts the process's own kernel back after the test
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_reason", None)


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """A loader that has not tried yet, building into an empty cache directory."""
    _forget_kernel(monkeypatch)
    monkeypatch.setenv("HLAT_OPTIM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def _eight_lane_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel-8-lanes")


@pytest.fixture
def eight_lane_kernel(monkeypatch, _eight_lane_cache):
    """The kernel as built for an x86 CPU without AVX-512 (8 lanes of 32 bits), so that an
    AVX-512 machine tests both loop widths."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the loop width is chosen by x86 target flags")
    _forget_kernel(monkeypatch)
    monkeypatch.setenv("HLAT_OPTIM_CACHE_DIR", str(_eight_lane_cache))
    monkeypatch.setenv("HLAT_OPTIM_CXXFLAGS", "-mno-avx512f")
    assert _native.load() is not None, _native.unavailable_reason()
