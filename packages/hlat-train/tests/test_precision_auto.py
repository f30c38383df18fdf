"""``optim.precision = "auto"``: bf16-sr where bf16 matrix products are native, fp32 where
they would be emulated; the run logs what it chose and trains in it."""

from __future__ import annotations

import platform

import pytest
import torch
from train_helpers import tiny_config

from hlat_model.linear import _ONEDNN_BELOW_BF16, onednn_max_isa
from hlat_train import Trainer
from hlat_train.precision import native_bf16, resolve_precision


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not _cpu_flags(), reason="reads x86 flags from /proc"
)
def test_the_cpu_choice_follows_the_flags_the_kernel_reports():
    """On x86 the rule is AVX512-BF16 or AMX tiles, checked here against /proc/cpuinfo: on an
    AVX2-only or plain AVX-512 CPU auto means fp32, on one with native bf16 bf16-sr."""
    flags = _cpu_flags()
    held = onednn_max_isa() in _ONEDNN_BELOW_BF16  # oneDNN limited: emulated on any CPU
    native = bool({"avx512_bf16", "amx_tile", "amx_bf16"} & flags) and not held
    choice = resolve_precision("auto", torch.device("cpu"))
    assert choice.mode == ("bf16-sr" if native else "fp32"), (sorted(flags), choice)
    assert (native_bf16(torch.device("cpu")) is not None) == native


def test_a_set_precision_is_kept_whatever_the_device():
    for mode in ("fp32", "bf16-sr", "mixed"):
        assert resolve_precision(mode, torch.device("cpu")).mode == mode


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"),
    [(False, False, "fp32"), (True, False, "bf16-sr"), (False, True, "bf16-sr")],
)
def test_each_x86_capability_decides(avx512_bf16, amx, expected, monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    choice = resolve_precision("auto", torch.device("cpu"))
    assert choice.mode == expected
    assert ("emulated" in choice.reason) == (expected == "fp32")


def test_onednn_held_below_bf16_means_fp32_on_any_cpu(monkeypatch):
    """With oneDNN limited to AVX2 its bf16 products convert in software even on a CPU with
    AMX tiles, so ``auto`` trains in fp32."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert resolve_precision("auto", torch.device("cpu")).mode == "fp32"


def test_trainium_is_bf16_sr():
    assert resolve_precision("auto", torch.device("xla")).mode == "bf16-sr"


def test_a_run_with_auto_logs_its_choice_and_trains_in_it(corpus, tmp_path, capsys):
    config = tiny_config(corpus, tmp_path, "--optim.precision=auto", steps=2)
    trainer = Trainer(config)
    try:
        trainer.fit()
        expected = resolve_precision("auto", trainer.device)
        assert config.optim.precision == expected.mode
        dtype = torch.float32 if expected.mode == "fp32" else torch.bfloat16
        assert {p.dtype for p in trainer.model.parameters()} == {dtype}
    finally:
        trainer.close()
    assert f"precision auto -> {expected.mode} ({expected.reason})" in capsys.readouterr().err
