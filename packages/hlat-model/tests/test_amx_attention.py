"""Causal attention on AMX tiles (the fused CPU kernels' flash-style kernel) against float64,
Hugging Face's eager attention and torch's SDPA. Where this CPU has no AMX tiles, only the
tests of when it runs do (the kernel's own are skipped, saying why)."""

import pytest
import torch
import torch.nn.functional as F

from hlat_model import Llama, LlamaConfig, _native, cross_entropy_loss
from hlat_model import attention as attention_module
from hlat_model.attention import AMX_BLOCK, amx_attention_reason, blocked_causal_attention

_REASON = amx_attention_reason()
amx = pytest.mark.skipif(_REASON is not None, reason=f"no AMX attention here: {_REASON}")


def _inputs(batch, heads, kv_heads, seq_len, head_dim, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = (scale * torch.randn(batch, heads, seq_len, head_dim, generator=generator)).bfloat16()
    k, v = (
        torch.randn(batch, kv_heads, seq_len, head_dim, generator=generator).bfloat16()
        for _ in range(2)
    )
    grad = torch.randn(batch, heads, seq_len, head_dim, generator=generator).bfloat16()
    return q, k, v, grad


def _run(fn, q, k, v, grad, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _reference(q, k, v, grad):
    gqa = q.shape[1] != k.shape[1]

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return _run(sdpa, q, k, v, grad, torch.float64)


def _eager(q, k, v):
    """Hugging Face's eager attention: bf16 products, softmax in fp32 rounded to bf16."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    causal = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _normwise_errors(results, reference):
    return [
        ((r.double() - ref).norm() / ref.norm()).item()
        for r, ref in zip(results, reference, strict=True)
    ]


CASES = {
    # batch, heads, kv heads, sequence, head dim, scale of q
    "small-heads": (2, 4, 4, 256, 32, 1.0),
    "model-shape": (1, 8, 8, 512, 64, 1.0),
    "gqa": (2, 4, 2, 256, 64, 1.0),
    "wide-heads": (1, 2, 2, 256, 128, 1.0),
    "peaked-softmax": (1, 4, 4, 256, 64, 8.0),
}


@amx
@pytest.mark.parametrize("case", CASES)
def test_error_is_that_of_eager_attention(case):
    """Against float64, the output and the three gradients are within 1.25x of Hugging
    Face's eager attention's norm-wise error on the same inputs (and under 1 %)."""
    *shape, scale = CASES[case]
    q, k, v, grad = _inputs(*shape, scale=scale)
    ours = _run(blocked_causal_attention, q, k, v, grad)
    reference = _reference(q, k, v, grad)
    eager = _normwise_errors(_run(_eager, q, k, v, grad), reference)
    for name, mine, theirs in zip(
        ("out", "dq", "dk", "dv"), _normwise_errors(ours, reference), eager, strict=True
    ):
        assert mine <= 1.25 * theirs and mine < 0.01, (name, mine, theirs)


@amx
def test_it_runs_where_it_should_and_keeps_only_linear_memory(saved_for_backward):
    """Plain causal bf16 attention whose sequence and head size are multiples of 32 runs the
    operator, which keeps q, k, v, the output and one fp32 log-sum-exp per query for
    backward (no probabilities); other shapes, fp32 and packed documents keep the blocked
    kernel."""
    q, k, v, _ = _inputs(2, 4, 4, 256, 64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with saved_for_backward() as saved:
        blocked_causal_attention(q, k, v)
    sizes = sorted(t.numel() * t.element_size() for t in saved)
    assert sizes == sorted([q.numel() * 2] * 4 + [2 * 4 * 256 * 4])
    assert attention_module._on_amx_tiles(q, k, v)
    for shape in ((2, 4, 300, 64), (2, 4, 256, 48)):
        t = torch.zeros(shape, dtype=torch.bfloat16)
        assert not attention_module._on_amx_tiles(t, t, t)
    assert not attention_module._on_amx_tiles(q.float(), k.float(), v.float())


@amx
def test_results_do_not_depend_on_the_thread_count():
    """Each (batch, head) runs whole on one thread: bit for bit the same with 1 thread."""
    q, k, v, grad = _inputs(2, 4, 4, 256, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(blocked_causal_attention, q, k, v, grad)
        torch.set_num_threads(max(2, threads))
        many = _run(blocked_causal_attention, q, k, v, grad)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)


@amx
def test_a_strided_output_gradient_gives_the_dense_ones_result():
    """The output's gradient as the output projection's backward lays it out ([B, S, H, D]
    memory) or with rows apart: the same gradients as from a contiguous one."""
    q, k, v, grad = _inputs(2, 4, 4, 128, 64)
    dense = _run(blocked_causal_attention, q, k, v, grad)
    as_projection = grad.transpose(1, 2).contiguous().transpose(1, 2)
    padded = torch.zeros(2, 4, 128, 96, dtype=torch.bfloat16)
    padded[..., :64] = grad
    for strided in (as_projection, padded[..., :64]):
        assert not strided.is_contiguous()
        for a, b in zip(_run(blocked_causal_attention, q, k, v, strided), dense, strict=True):
            assert torch.equal(a, b)


@amx
def test_the_operator_passes_torchs_checks():
    q, k, v, _ = _inputs(1, 2, 2, 64, 32)
    args = tuple(t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.hlat.amx_causal_attention.default, args)


@amx
def test_a_bf16_llama_trains_on_it_as_on_sdpa():
    """Logits and every gradient of a small bf16 model, AMX attention against SDPA: as close
    as two bf16 runs of different kernels get (relative to each tensor's largest value)."""
    torch.manual_seed(0)
    config = dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=128)
    models = {
        kernel: Llama(LlamaConfig(**config, attention=kernel)).to(torch.bfloat16)
        for kernel in ("sdpa", "blocked")
    }
    models["blocked"].load_state_dict(models["sdpa"].state_dict())
    tokens = torch.randint(0, 256, (2, 129))
    results = {}
    for kernel, model in models.items():
        logits = model(tokens[:, :-1])
        cross_entropy_loss(logits, tokens[:, 1:]).backward()
        results[kernel] = [logits.detach()] + [p.grad for p in model.parameters()]
    for ours, theirs in zip(results["blocked"], results["sdpa"], strict=True):
        scale = theirs.float().abs().max()
        assert (ours.float() - theirs.float()).abs().max() <= 0.03 * scale


@amx
@pytest.mark.compile
def test_compiled_code_calls_the_operator(traced_targets):
    q, k, v, _ = _inputs(1, 2, 2, 64, 32)
    targets = traced_targets(blocked_causal_attention, q, k, v)
    assert "hlat.amx_causal_attention" in targets
    compiled = torch.compile(blocked_causal_attention, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), blocked_causal_attention(q, k, v))


def test_it_says_why_it_does_not_run(monkeypatch):
    monkeypatch.setenv("HLAT_MODEL_AMX_ATTENTION", "0")
    assert amx_attention_reason() == "turned off by HLAT_MODEL_AMX_ATTENTION=0"
    q = torch.zeros(1, 1, AMX_BLOCK, AMX_BLOCK, dtype=torch.bfloat16)
    assert not attention_module._on_amx_tiles(q, q, q)
    monkeypatch.delenv("HLAT_MODEL_AMX_ATTENTION")
    monkeypatch.setenv("HLAT_MODEL_NATIVE", "0")
    _native.reset()
    try:
        assert amx_attention_reason().startswith("no fused CPU kernels (turned off by")
    finally:
        _native.reset()
    monkeypatch.delenv("HLAT_MODEL_NATIVE")
    if _native.load() is not None:
        monkeypatch.setattr(_native, "amx_attention_ready", lambda lib: False)
        monkeypatch.setattr(attention_module, "_cpu_has_amx", lambda: False)
        assert amx_attention_reason() == "this CPU has no AMX tiles"


@amx
@pytest.mark.parametrize("asked, amx_runs", [("auto", True), ("sdpa", False), ("blocked", True)])
def test_auto_takes_it_over_the_flash_kernel_for_long_sequences(
    asked, amx_runs, monkeypatch, saved_for_backward
):
    """On a CPU with AMX, ``auto``'s rule picks torch's flash kernel from 2,048 tokens; the
    AMX attention takes those sequences over where it runs (bf16, multiples of 32), while
    an explicit ``sdpa`` keeps torch's kernel."""
    monkeypatch.setattr(attention_module, "_cpu_has_amx", lambda: True)
    seq_len = attention_module.SDPA_FROM_TOKENS_WITH_AMX
    mask = attention_module.AttentionMask.build(None, seq_len, asked, torch.device("cpu"))
    assert mask.amx == (asked == "auto")
    q, k, v, _ = _inputs(1, 2, 2, seq_len, 32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with saved_for_backward() as saved:
        attention_module.attention(q, k, v, mask)
    lse = [t for t in saved if t.dtype == torch.float32 and t.shape == (2, seq_len)]
    assert bool(lse) == amx_runs
    # fp32 keeps what the rule chose
    with saved_for_backward() as saved:
        attention_module.attention(q.float(), k.float(), v.float(), mask)
    assert not [t for t in saved if t.shape == (2, seq_len)]
