"""Which bf16 and fp32 paths ``Linear`` and the attention core take on a CPU, and that the
fp32-accumulating path gives the numbers of a native bf16 kernel (bf16 operands, fp32
accumulation, one rounding to bf16)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import hlat_model.attention as attention_module
import hlat_model.linear as linear_module
from hlat_model.attention import AttentionMask, attention
from hlat_model.linear import Linear, cpu_bf16_reason


def _cpuinfo(field: str) -> str:
    """The first ``field`` line of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not _cpu_flags(), reason="reads x86 flags from /proc"
)
def test_the_rule_on_this_cpu_follows_the_flags_the_kernel_reports():
    held = linear_module.onednn_max_isa() in linear_module._ONEDNN_BELOW_BF16
    native = bool({"avx512_bf16", "amx_tile", "amx_bf16"} & _cpu_flags()) and not held
    assert (cpu_bf16_reason() is not None) == native
    assert linear_module.cpu_has_native_bf16() == native


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "native"),
    [(False, False, False), (True, False, True), (False, True, True)],
    ids=["avx2-or-plain-avx512", "avx512-bf16", "amx"],
)
def test_on_x86_only_bf16_instructions_count(avx512_bf16, amx, native, monkeypatch):
    """A plain AVX-512 CPU is 'emulated' although oneDNN's own check says yes there: its bf16
    kernels convert in software (see ``cpu_bf16_reason``)."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    reason = cpu_bf16_reason()
    assert (reason is not None) == native
    if native:
        assert ("AMX" if amx else "AVX512-BF16") in reason


@pytest.mark.parametrize(
    ("variable", "value", "native"),
    [
        ("ONEDNN_MAX_CPU_ISA", "AVX2", False),
        ("ONEDNN_MAX_CPU_ISA", "avx512_core", False),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI", False),
        ("DNNL_MAX_CPU_ISA", "AVX2_VNNI_2", False),
        ("ONEDNN_MAX_CPU_ISA", "SSE41", False),
        ("DNNL_MAX_CPU_ISA", "avx", False),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", True),
        ("ONEDNN_MAX_CPU_ISA", "AVX10_1_512_AMX", True),
        ("ONEDNN_MAX_CPU_ISA", "ALL", True),
        ("ONEDNN_MAX_CPU_ISA", "", True),
    ],
)
def test_onednn_held_below_bf16_makes_bf16_emulated(variable, value, native, monkeypatch):
    """oneDNN's instruction-set limit decides, whatever the CPU has: below AVX512-BF16 its
    bf16 kernels convert in software."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert (cpu_bf16_reason() is not None) == native
    # the fp32 rule leaves oneDNN only below AVX2
    fp32 = linear_module.fp32_onednn_rule(
        "x86_64", "AuthenticAMD", "AVX512", True, linear_module.onednn_max_isa()
    )
    assert (fp32 is None) == (value.upper() in ("SSE41", "AVX"))


def test_a_process_with_onednn_held_to_avx2_takes_the_fp32_accumulating_path():
    """A fresh interpreter with ``ONEDNN_MAX_CPU_ISA=AVX2``: the rule asked at import says
    emulated, ``Linear`` in bf16 accumulates in fp32, and its result is the fp32 product
    (oneDNN's where the fp32 rule sends products there) rounded once, on any CPU."""
    script = (
        "import torch, torch.nn.functional as F\n"
        "import hlat_model.linear as m\n"
        "assert not m.cpu_has_native_bf16(), m.cpu_bf16_reason()\n"
        "layer = m.Linear(64, 48).to(torch.bfloat16)\n"
        "x = torch.randn(5, 64, dtype=torch.bfloat16, requires_grad=True)\n"
        "out = layer(x)\n"
        "name = type(out.grad_fn).__name__\n"
        "assert name.startswith('_Fp32AccumulateLinear'), name\n"
        "product = m._onednn_linear if m.cpu_fp32_onednn_reason() else F.linear\n"
        "ref = product(x.detach().float(), layer.weight.detach().float()).to(torch.bfloat16)\n"
        "assert torch.equal(out, ref)\n"
        "print('emulated')\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "emulated"


def _linear_case(seed: int = 0) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(seed)
    layer = Linear(96, 80).to(torch.bfloat16)
    x = torch.randn(3, 7, 96, dtype=torch.bfloat16, requires_grad=True)
    return layer, x


@pytest.mark.parametrize("native", [True, False], ids=["native", "emulated"])
def test_linear_takes_the_path_of_the_rule(native, monkeypatch):
    monkeypatch.setattr(linear_module, "cpu_has_native_bf16", lambda: native)
    layer, x = _linear_case()
    out = layer(x)
    fp32_path = type(out.grad_fn).__name__.startswith("_Fp32AccumulateLinear")
    assert fp32_path == (not native), type(out.grad_fn).__name__
    # fp32 weights and inputs never take the bf16 path
    assert not type(Linear(4, 3)(torch.randn(2, 4)).grad_fn).__name__.startswith("_Fp32")


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "torch"])
def test_the_fp32_accumulating_path_rounds_once_from_fp32_products(onednn, monkeypatch):
    """The fp32 products of fp32 copies, rounded once: forward and the input's gradient by
    oneDNN's product where the fp32 rule says so (forced here either way), else torch's."""
    monkeypatch.setattr(linear_module, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(
        linear_module, "_CPU_FP32_ONEDNN", "forced in this test" if onednn else None
    )
    layer, x = _linear_case(1)
    out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    w32, x32, g32 = layer.weight.float(), x.detach().float(), grad.float()
    forward = linear_module._onednn_linear(x32, w32) if onednn else F.linear(x32, w32)
    backward = linear_module._onednn_linear(g32, w32.t()) if onednn else g32 @ w32
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, forward.to(torch.bfloat16))
    assert torch.equal(x.grad, backward.to(torch.bfloat16))
    # either product is the fp32 product: within one bf16 rounding of torch's
    torch.testing.assert_close(out, F.linear(x32, w32).to(torch.bfloat16), atol=0, rtol=2**-7)
    flat_g, flat_x = g32.reshape(-1, g32.shape[-1]), x32.reshape(-1, x32.shape[-1])
    assert torch.equal(layer.weight.grad, (flat_g.t() @ flat_x).to(torch.bfloat16))


@pytest.mark.parametrize("native", [True, False], ids=["native", "emulated"])
def test_attention_in_bf16_agrees_on_both_paths(native, monkeypatch):
    """Emulated: SDPA on fp32 copies, rounded once, exactly; native: bf16 SDPA, within bf16's
    rounding of the same result."""
    monkeypatch.setattr(attention_module, "cpu_has_native_bf16", lambda: native)
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.bfloat16) for _ in range(3))
    out = attention(q, k, v, AttentionMask("causal"))
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert out.dtype == torch.bfloat16
    if native:
        torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
    else:
        assert torch.equal(out, reference.to(torch.bfloat16))


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not _cpuinfo("vendor_id"),
    reason="reads the x86 vendor from /proc",
)
def test_the_fp32_rule_on_this_cpu_follows_the_vendor_and_flags_the_kernel_reports(
    monkeypatch, tmp_path
):
    """The rule allows oneDNN on non-Intel x86 CPUs with AVX2 or AVX-512; ``auto`` takes it
    there where this machine's measurement (timed here, into an empty cache) says it ran at
    least :data:`ONEDNN_MARGIN` times as fast as MKL's, and says so."""
    vendor = _cpuinfo("vendor_id")
    flags = _cpu_flags()
    allowed = vendor != "GenuineIntel" and ("avx512f" in flags or "avx2" in flags)
    candidate = linear_module._cpu_fp32_onednn()
    assert (candidate is not None) == allowed
    monkeypatch.delenv(linear_module.FP32_PRODUCTS_VARIABLE, raising=False)
    monkeypatch.setenv("HLAT_MODEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear_module, "_CPU_FP32_ONEDNN", linear_module._UNRESOLVED)
    reason = linear_module.cpu_fp32_onednn_reason()
    if not allowed:
        assert reason is None
        assert not list(tmp_path.iterdir())  # nothing timed where the rule says MKL
        return
    speedup = linear_module.measured_fp32_products()
    assert (reason is not None) == (speedup >= linear_module.ONEDNN_MARGIN), (reason, speedup)
    if reason is not None:
        assert vendor in reason and f"{speedup:.2f}x" in reason


def _unresolved(monkeypatch, choice: str | None) -> None:
    """The next ``cpu_fp32_onednn_reason`` decides afresh, under this variable's value."""
    if choice is None:
        monkeypatch.delenv(linear_module.FP32_PRODUCTS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(linear_module.FP32_PRODUCTS_VARIABLE, choice)
    monkeypatch.setattr(linear_module, "_CPU_FP32_ONEDNN", linear_module._UNRESOLVED)


@pytest.mark.parametrize(
    ("choice", "allowed", "speedup", "onednn"),
    [
        ("auto", True, 1.2, True),
        (None, True, 1.2, True),
        ("auto", True, 1.01, False),  # within the margin: MKL, torch's default, stays
        ("auto", True, 0.9, False),
        ("auto", False, 1.5, False),
        ("torch", True, 1.5, False),
        ("onednn", False, 0.5, True),
        (" OneDNN ", True, 0.5, True),
    ],
)
def test_fp32_products_follow_the_variable_the_rule_and_the_measurement(
    choice, allowed, speedup, onednn, monkeypatch
):
    timed: list[bool] = []

    def measured() -> float:
        timed.append(True)
        return speedup

    _unresolved(monkeypatch, choice)
    monkeypatch.setattr(linear_module, "_cpu_fp32_onednn", lambda: "rule" if allowed else None)
    monkeypatch.setattr(linear_module, "measured_fp32_products", measured)
    reason = linear_module.cpu_fp32_onednn_reason()
    assert (reason is not None) == (onednn and torch.backends.mkldnn.is_available())
    # timed only where auto has the rule's leave
    assert bool(timed) == ((choice or "auto") == "auto" and allowed)
    assert linear_module.cpu_fp32_onednn_reason() == reason  # decided once
    assert len(timed) <= 1
    layer, x = Linear(16, 8), torch.randn(4, 16)
    name = type(layer(x).grad_fn).__name__
    assert name.startswith("_OneDnnLinear") == (reason is not None), name


def test_a_wrong_fp32_products_value_is_refused_by_name(monkeypatch):
    _unresolved(monkeypatch, "mkl")
    with pytest.raises(ValueError, match=r"HLAT_MODEL_FP32_PRODUCTS='mkl'.*auto, onednn, torch"):
        linear_module.cpu_fp32_onednn_reason()
    done = subprocess.run(
        [sys.executable, "-c", "import hlat_model"],
        env={**os.environ, linear_module.FP32_PRODUCTS_VARIABLE: "fast"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0 and "HLAT_MODEL_FP32_PRODUCTS='fast'" in done.stderr


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_the_measurement_is_timed_once_per_machine_and_kept(monkeypatch, tmp_path):
    """Real products, timed into an empty cache folder; a later call reads the file instead
    of timing again; a value already there (another process's) wins over a new timing; a
    folder that cannot be made still gives this process's own timing."""
    monkeypatch.setenv("HLAT_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    first = linear_module.measured_fp32_products()
    assert 0.05 < first < 20
    (kept,) = (tmp_path / "cache").glob("fp32_products_*.json")
    assert json.loads(kept.read_text())["onednn_vs_torch"] == first

    def timing() -> float:
        raise AssertionError("timed again")

    monkeypatch.setattr(linear_module, "_probe_fp32_products", timing)
    assert linear_module.measured_fp32_products() == first
    kept.write_text(json.dumps({"onednn_vs_torch": 4.5}))
    assert linear_module.measured_fp32_products() == 4.5
    monkeypatch.setattr(linear_module, "_probe_fp32_products", lambda: 0.75)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HLAT_MODEL_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    assert linear_module.measured_fp32_products() == 0.75


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_processes_started_together_take_the_same_fp32_products(tmp_path):
    """Two processes timing into one empty cache folder at once (as the ranks of a job
    starting on one machine) read the same answer: the first one written."""
    script = "import hlat_model.linear as m; print(repr(m.measured_fp32_products()))"
    env = {**os.environ, "HLAT_MODEL_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert outputs[0] == outputs[1], outputs
    (kept,) = tmp_path.glob("fp32_products_*.json")
    assert repr(json.loads(kept.read_text())["onednn_vs_torch"]) == outputs[0]


@pytest.mark.parametrize(
    ("machine", "vendor", "capability", "available", "onednn"),
    [
        ("x86_64", "AuthenticAMD", "AVX512", True, True),
        ("x86_64", "GenuineIntel", "AVX512", True, False),
        ("x86_64", "AuthenticAMD", "AVX2", True, True),
        ("x86_64", "GenuineIntel", "AVX2", True, False),
        ("x86_64", "AuthenticAMD", "DEFAULT", True, False),
        ("x86_64", "", "AVX512", True, False),
        ("x86_64", "AuthenticAMD", "AVX512", False, False),
        ("aarch64", "", "SVE256", True, False),
    ],
    ids=[
        "amd-avx512",
        "intel-avx512",
        "amd-avx2",
        "intel-avx2",
        "amd-below-avx2",
        "unknown-vendor",
        "no-onednn",
        "arm",
    ],
)
def test_fp32_products_go_through_onednn_only_on_non_intel_x86_with_avx2_or_avx512(
    machine, vendor, capability, available, onednn
):
    reason = linear_module.fp32_onednn_rule(machine, vendor, capability, available)
    assert (reason is not None) == onednn


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "torch"])
def test_fp32_linear_takes_the_path_of_the_rule_and_matches_float64(onednn, monkeypatch):
    """Both fp32 paths, whatever this CPU's rule says: oneDNN's product (forward and the
    input's gradient) or torch's; each within fp32 rounding of float64, for a contiguous
    and a transposed input, in a permuted-rows product too."""
    reason = "forced in this test" if onednn else None
    monkeypatch.setattr(linear_module, "_CPU_FP32_ONEDNN", reason)
    torch.manual_seed(0)
    layer = Linear(96, 80)
    for x in (torch.randn(3, 7, 96), torch.randn(96, 5).t()):
        x.requires_grad_(True)
        out = layer(x)
        assert type(out.grad_fn).__name__.startswith("_OneDnnLinear") == onednn
        grad = torch.randn_like(out)
        out.backward(grad)
        x64, w64, g64 = x.detach().double(), layer.weight.detach().double(), grad.double()
        flat_g, flat_x = g64.reshape(-1, 80), x64.reshape(-1, 96)
        expected = {
            "out": (out, F.linear(x64, w64)),
            "x.grad": (x.grad, g64 @ w64),
            "weight.grad": (layer.weight.grad, flat_g.t() @ flat_x),
        }
        for name, (got, want) in expected.items():
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=name)
        layer.weight.grad = None
    rows = torch.randperm(80)
    x = torch.randn(4, 96, requires_grad=True)
    out = linear_module.linear_permuted_rows(x, layer.weight, rows)
    out.sum().backward()
    w64, x64 = layer.weight.detach().double(), x.detach().double()
    tolerance = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), x64 @ w64[rows].t(), **tolerance)
    torch.testing.assert_close(x.grad.double(), w64.sum(0).expand(4, 96), **tolerance)
    torch.testing.assert_close(layer.weight.grad.double(), x64.sum(0).expand(80, 96), **tolerance)


def test_cpu_autocast_keeps_torchs_product_where_the_fp32_rule_would_take_onednn(monkeypatch):
    monkeypatch.setattr(linear_module, "_CPU_FP32_ONEDNN", "forced in this test")
    layer, x = Linear(96, 80), torch.randn(3, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.to(torch.bfloat16), layer.weight.to(torch.bfloat16)))


def test_code_being_compiled_keeps_torchs_product_where_the_fp32_rule_would_take_onednn(
    monkeypatch, traced_targets
):
    """Compiled code multiplies with ``F.linear`` (inductor's lowering of oneDNN's linear
    operator takes prepacked weights only): dynamo's graph holds no oneDNN call."""
    monkeypatch.setattr(linear_module, "_CPU_FP32_ONEDNN", "forced in this test")
    targets = traced_targets(Linear(96, 80), torch.randn(3, 96))
    assert "<built-in function linear>" in targets, targets
    assert not any("mkldnn" in t for t in targets), targets
