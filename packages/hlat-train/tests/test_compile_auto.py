"""``model.compile = "auto"`` (``hlat_train.compiling``): on where the benchmark measured a
gain (bf16 on CPUs and CUDA GPUs that multiply bf16 natively, runs long enough to repay the
compilation), off elsewhere with the reason; ``true``/``false`` as given; other values refused."""

from __future__ import annotations

import pytest
import torch

from hlat_train import ConfigError, TrainConfig
from hlat_train.compiling import AUTO_MIN_STEPS, resolve_compile
from hlat_train.validation import validate


def _config(*overrides: str, steps: int = AUTO_MIN_STEPS) -> TrainConfig:
    return TrainConfig.preset(
        "tiny-check", [f"--train.steps={steps}", "--optim.precision=bf16-sr", *overrides]
    )


def native(device: torch.device) -> str:
    return "this CPU has AVX512-BF16"


def emulated(device: torch.device) -> None:
    return None


CPU = torch.device("cpu")


def kernels_off() -> str:
    return "turned off by HLAT_MODEL_NATIVE=0"


def kernels_on() -> None:
    return None


def test_auto_compiles_long_bf16_runs_on_cpus_with_native_bf16_without_the_fused_kernels():
    choice = resolve_compile(
        "auto", _config(), CPU, bf16_reason=native, cpu_kernels_reason=kernels_off
    )
    assert choice.on
    assert choice.describe("auto") == (
        f"compile auto -> on (bf16 for {AUTO_MIN_STEPS} steps (this CPU has AVX512-BF16): "
        "compiled blocks measured 1.06x-1.07x eager without the fused CPU kernels)"
    )
    for precision in ("bf16", "mixed", "bf16-kahan"):  # every mode that computes in bf16
        assert resolve_compile(
            "auto",
            _config(f"--optim.precision={precision}"),
            CPU,
            bf16_reason=native,
            cpu_kernels_reason=kernels_off,
        ).on


def test_auto_stays_eager_on_cpus_where_the_fused_kernels_run():
    choice = resolve_compile(
        "auto", _config(), CPU, bf16_reason=native, cpu_kernels_reason=kernels_on
    )
    assert not choice.on
    assert "fused CPU kernels: compiled blocks measured 0.95x eager" in choice.reason
    # a GPU is not asked
    gpu = resolve_compile(
        "auto", _config(), torch.device("cuda"), bf16_reason=native, cpu_kernels_reason=kernels_on
    )
    assert gpu.on


def test_auto_asks_hlat_model_whether_its_kernels_run(monkeypatch):
    """By default the rule asks hlat-model itself (here with the kernels turned off)."""
    from hlat_model import _native

    monkeypatch.setenv("HLAT_MODEL_NATIVE", "0")
    _native.reset()
    try:
        assert resolve_compile("auto", _config(), CPU, bf16_reason=native).on
    finally:
        _native.reset()


@pytest.mark.parametrize(
    ("overrides", "steps", "reason", "device"),
    [
        ((), AUTO_MIN_STEPS - 1, f"{AUTO_MIN_STEPS - 1} steps: auto compiles runs of", "cpu"),
        (("--optim.precision=fp32",), AUTO_MIN_STEPS, "fp32 on a CPU", "cpu"),
        ((), AUTO_MIN_STEPS - 1, f"{AUTO_MIN_STEPS - 1} steps: auto compiles runs of", "cuda"),
        (("--optim.precision=fp32",), AUTO_MIN_STEPS, "fp32 on a GPU: not measured", "cuda"),
        ((), AUTO_MIN_STEPS, "not measured on xpu", "xpu"),
        ((), AUTO_MIN_STEPS, "not measured on xla", "xla"),
        (
            ("--parallel.pp=2",),
            AUTO_MIN_STEPS,
            "refused with true: model.compile = true with parallel.pp = 2",
            "cpu",
        ),
        (
            ("--parallel.cp=2",),
            AUTO_MIN_STEPS,
            "refused with true: model.compile = true with parallel.pp = 1, cp = 2",
            "cpu",
        ),
        (
            ("--parallel.backend=neuron",),
            AUTO_MIN_STEPS,
            "XLA compiles the whole step there",
            "cpu",
        ),
    ],
    ids=["short-run", "fp32", "cuda-short-run", "cuda-fp32", "xpu", "xla", "pp", "cp", "trn1"],
)
def test_auto_stays_eager_elsewhere_and_says_why(overrides, steps, reason, device):
    choice = resolve_compile(
        "auto", _config(*overrides, steps=steps), torch.device(device), bf16_reason=native
    )
    assert not choice.on
    assert reason in choice.describe("auto")


def test_auto_compiles_long_bf16_runs_on_gpus_with_native_bf16():
    def tensor_cores(device: torch.device) -> str:
        return "NVIDIA H200 has bf16 tensor cores"

    choice = resolve_compile("auto", _config(), torch.device("cuda"), bf16_reason=tensor_cores)
    assert choice.on
    assert choice.reason == (
        f"bf16 for {AUTO_MIN_STEPS} steps (NVIDIA H200 has bf16 tensor cores): "
        "compiled blocks measured 1.28x-1.29x eager on an H200"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_reads_this_gpus_bf16_support():
    device = torch.device("cuda", torch.cuda.current_device())
    choice = resolve_compile("auto", _config(), device)
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert choice.on is native
    assert (torch.cuda.get_device_name(device) in choice.reason) is native


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_stays_eager_where_bf16_is_emulated(device):
    choice = resolve_compile("auto", _config(), torch.device(device), bf16_reason=emulated)
    assert not choice.on and "without native bf16" in choice.reason


def test_auto_stays_eager_where_a_compiled_tp_block_with_sdpa_would_fail():
    from hlat_train.validation import compiled_tp_checkpoints_fail

    # on the CPU, where model.attention = "auto" is the blocked kernel (on a GPU it is SDPA)
    tp = ("--train.device=cpu", "--parallel.tp=2", "--model.checkpointing=selective")
    config = _config(*tp)
    sdpa = _config(*tp, "--model.attention=sdpa")
    # the blocked kernel compiles under TP and selective checkpointing; SDPA may not
    assert resolve_compile(
        "auto", config, CPU, bf16_reason=native, cpu_kernels_reason=kernels_off
    ).on
    choice = resolve_compile("auto", sdpa, CPU, bf16_reason=native, cpu_kernels_reason=kernels_off)
    assert choice.on is not compiled_tp_checkpoints_fail()


def test_which_attention_a_compiled_tp_block_runs_follows_the_run(monkeypatch):
    """Validation asks whether attention runs hlat-model's kernels (which compile inside a
    checkpointed region of a TP block) for the run's documents, sequence and head size: on a
    CPU with AMX tiles, ``auto`` gives plain causal attention of 2,048 tokens to torch's
    SDPA unless hlat-model's flash kernels take it."""
    from hlat_model import attention as hlat_attention
    from hlat_train.validation import runs_hlat_attention

    monkeypatch.setattr(hlat_attention, "_cpu_has_amx", lambda: True)
    assert runs_hlat_attention("blocked", "cpu", False, 2048, 64)
    assert not runs_hlat_attention("sdpa", "cpu", False, 2048, 64)
    assert runs_hlat_attention("auto", "cpu", True, 2048, 64)  # packed documents: blocked
    assert runs_hlat_attention("auto", "cpu", False, 1024, 64)  # shorter: blocked
    monkeypatch.setattr(hlat_attention, "bf16_flash_attention_reason", lambda: None)
    monkeypatch.setattr(hlat_attention, "fp32_flash_attention_reason", lambda: None)
    assert runs_hlat_attention("auto", "cpu", False, 2048, 64)  # the flash kernels take it
    assert not runs_hlat_attention("auto", "cpu", False, 2048, 48)  # but not 48-wide heads
    monkeypatch.setattr(hlat_attention, "bf16_flash_attention_reason", lambda: "no kernels")
    assert not runs_hlat_attention("auto", "cpu", False, 2048, 64)


def test_true_and_false_are_taken_as_given():
    for asked in (True, False):
        choice = resolve_compile(asked, _config("--optim.precision=fp32"), CPU)
        assert (
            choice.on is asked and choice.describe(asked) == f"compile {'on' if asked else 'off'}"
        )


def test_the_config_takes_true_false_and_auto_and_refuses_other_values():
    assert TrainConfig.preset("tiny-check").model.compile == "auto"  # the default
    assert _config("--model.compile=true").model.compile is True
    assert _config("--model.compile=false").model.compile is False
    validate(_config("--model.compile=auto"), check_files=False)
    with pytest.raises(ConfigError, match=r"model\.compile must be true, false or 'auto'"):
        validate(_config("--model.compile=sometimes"), check_files=False)
    with pytest.raises(ValueError, match="got 'sometimes'"):
        resolve_compile("sometimes", _config(), CPU)
