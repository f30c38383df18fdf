"""The fused CPU kernels as registered operators in code being compiled (RMSNorm, SwiGLU, the
RoPE head split): torch's own operator checks, where compiled blocks take them, and a
compiled Llama against the eager one."""

import pytest
import torch

from hlat_model import Llama, LlamaConfig, _native
from hlat_model._compiled_ops import compiled_cpu_kernels
from hlat_model.model import Block, block_inputs

DTYPES = [torch.float32, torch.bfloat16]
CONFIG = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96)


def _library():
    lib = _native.load()
    assert lib is not None, _native.unavailable_reason()
    return lib


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_operators_pass_torchs_operator_checks(dtype):
    """``torch.library.opcheck``: schema, fake implementations (shapes, dtypes, strides)
    against the real outputs, the registered backward, and AOT dispatch."""
    _library()
    x = torch.randn(2, 7, 32).to(dtype).requires_grad_()
    weight = torch.randn(32).to(dtype).requires_grad_()
    torch.library.opcheck(torch.ops.hlat.rms_norm.default, (x, weight, 1e-5))
    gate_up = torch.randn(2, 7, 48).to(dtype).requires_grad_()
    for interleaved in (False, True):
        torch.library.opcheck(torch.ops.hlat.swiglu.default, (gate_up, interleaved))
    qkv = torch.randn(2, 7, 2, 4, 16).to(dtype).requires_grad_()  # 2 groups of 2 q heads
    cos, sin = (t[None, :, None, :] for t in (torch.randn(7, 8), torch.randn(7, 8)))
    torch.library.opcheck(torch.ops.hlat.rope_heads.default, (qkv, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_blocks_call_the_kernels_only_where_they_run(dtype, traced_targets, kernels):
    """dynamo's graph of a block holds the three operators with the kernels and none of
    them without (inductor then fuses torch's operators itself)."""
    config = LlamaConfig(**CONFIG)
    block = Block(config).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    h = torch.randn(2, 16, config.dim).to(dtype)
    cos, sin, mask = block_inputs(config, torch.arange(16).expand(2, 16))
    traced = traced_targets(lambda h: block(h, cos, sin, mask), h)
    ops = {
        name: any(f"hlat.{name}" in t for t in traced)
        for name in ("rms_norm", "swiglu", "rope_heads")
    }
    assert ops == dict.fromkeys(ops, kernels == "native"), traced


def test_outside_compiled_code_and_under_autocast_the_kernels_are_not_operators():
    _library()
    x = torch.randn(4, 8)
    assert not compiled_cpu_kernels(x)  # eager code calls the kernels directly
    checked = []

    def fn(x):
        checked.append(compiled_cpu_kernels(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            checked.append(compiled_cpu_kernels(x))
        checked.append(compiled_cpu_kernels(x.to(torch.float64)))
        return x + 1

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend="eager", fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    assert checked == [True, False, False]


@pytest.mark.compile
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_compiled_llama_with_the_operators_trains_as_the_eager_one(dtype):
    """Each block compiled by inductor around the operators: the eager model's loss and
    gradients (both run the same kernels; inductor compiles the rest)."""
    _library()
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    eager = Llama(config).to(dtype)
    compiled = Llama(config).to(dtype)
    compiled.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, config.vocab_size, (2, 33))
    torch._dynamo.reset()
    try:
        for layer in compiled.layers:
            layer.compile(fullgraph=True)
        losses = [m(tokens[:, :-1], labels=tokens[:, 1:]) for m in (eager, compiled)]
        for loss in losses:
            loss.backward()
    finally:
        torch._dynamo.reset()
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0.02, atol=2e-3)
    torch.testing.assert_close(losses[1], losses[0], **tolerance)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad.float(), a.grad.float(), **tolerance, msg=name)
