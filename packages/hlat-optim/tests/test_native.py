"""The CPU kernel's build, cache and failure handling (real compiler runs, no mocks)."""

import pytest
import torch

from hlat_optim import AdamW, _native


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """A loader that has not tried yet, building into an empty cache directory."""
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_reason", None)
    monkeypatch.setenv("HLAT_OPTIM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_builds_once_into_the_cache_and_reuses_it(fresh_loader, monkeypatch):
    assert _native.load() is not None, _native.unavailable_reason()
    built = list(fresh_loader.glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(_native, "_tried", False)
    assert _native.load() is not None
    assert [p.stat().st_mtime_ns for p in fresh_loader.glob("*.so")] == [stamp]
    assert not [p for p in fresh_loader.iterdir() if p.suffix != ".so"]  # no temp files left


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
    AdamW([p], impl="auto").step()  # the compiled path instead
    q = torch.nn.Parameter(expected)
    q.grad = torch.ones_like(q)
    AdamW([q], impl="reference").step()
    assert torch.equal(p.view(torch.int16), q.view(torch.int16))


def test_disabled_by_environment(fresh_loader, monkeypatch):
    monkeypatch.setenv("HLAT_OPTIM_NATIVE", "0")
    assert _native.load() is None
    assert _native.unavailable_reason() == "disabled by HLAT_OPTIM_NATIVE=0"
