"""The blocked causal attention kernel against torch's SDPA, with float64 as the reference;
and the flash-style kernels it hands plain causal attention (and ``auto``, packed documents)
to: bf16 on CPUs with AMX tiles
or AVX512-BF16, fp32 on CPUs with AVX-512 (the tests of a kernel skip elsewhere, saying why;
those of when they run run anywhere)."""

import pytest
import torch
import torch.nn.functional as F

from hlat_model import Llama, LlamaConfig, _native, cross_entropy_loss
from hlat_model import attention as attention_module
from hlat_model.attention import (
    FLASH_BLOCK,
    SDPA_FROM_TOKENS_WITH_AMX,
    AttentionMask,
    amx_attention_reason,
    bf16_flash_attention_reason,
    blocked_causal_attention,
    cpu_attention_rule,
    document_first_keys,
    fp32_flash_attention_reason,
    query_block,
)


@pytest.fixture(autouse=True)
def _blocked_kernel(monkeypatch):
    """The blocked kernel's tests: the flash kernels, which would take their plain causal
    cases (bf16 on CPUs with AMX or AVX512-BF16, fp32 on CPUs with AVX-512), are off (the
    ``flash_on`` fixture turns one on)."""
    monkeypatch.setenv("HLAT_MODEL_FLASH_ATTENTION", "0")


_FP32_FLASH = fp32_flash_attention_reason()


def _inputs(batch, heads, kv_heads, seq_len, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=generator).to(dtype)
    k, v = (
        torch.randn(batch, kv_heads, seq_len, head_dim, generator=generator).to(dtype)
        for _ in range(2)
    )
    grad = torch.randn(batch, heads, seq_len, head_dim, generator=generator).to(dtype)
    return q, k, v, grad


def _run(fn, q, k, v, grad, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _sdpa(allowed, gqa):
    def fn(q, k, v):
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)

    return fn


def _relative_errors(results, reference):
    """Largest error of each result against its reference, relative to the reference's
    largest magnitude."""
    return [
        ((r.double() - ref).abs().max() / ref.abs().max()).item()
        for r, ref in zip(results, reference, strict=True)
    ]


def _normwise_errors(results, reference):
    """Norm of each result's error against its reference, relative to the reference's norm.

    Note: the bf16 comparisons with eager attention use it, not :func:`_relative_errors`:
    one element's error is one draw. Over 8 seeds at the shapes of ``CASES``, at 4 x 8 x
    512 x 64 and at 1 x 8 x 2048 x 64, the kernel's largest-element error went up to 1.8x
    eager attention's for the query gradient and 2.6x for the value gradient (0.74x to
    1.60x on average), its norm-wise error to 1.17x (0.80x to 1.16x on average)."""
    return [
        ((r.double() - ref).norm() / ref.norm()).item()
        for r, ref in zip(results, reference, strict=True)
    ]


def _document_mask(batch, seq_len):
    lens = torch.tensor([[seq_len // 3, seq_len // 2, seq_len - seq_len // 3 - seq_len // 2]])
    return AttentionMask.build(lens.expand(batch, 3), seq_len, "blocked", torch.device("cpu")).mask


CASES = {
    # batch, heads, kv heads, sequence (not a multiple of the block: 300), head dim, documents
    "causal": (2, 4, 4, 256, 32, False),
    "gqa-uneven-sequence": (2, 4, 2, 300, 32, False),
    "documents": (2, 4, 4, 256, 32, True),
    "gqa-documents-uneven": (1, 4, 1, 300, 16, True),
}


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("case", CASES)
def test_fp32_outputs_and_gradients_equal_sdpa(case, keep, monkeypatch, kernels):
    if not keep:
        monkeypatch.setattr(attention_module, "KEEP_PROBABILITIES_BYTES", 0)
    batch, heads, kv_heads, seq_len, head_dim, documents = CASES[case]
    q, k, v, grad = _inputs(batch, heads, kv_heads, seq_len, head_dim, torch.float32)
    allowed = _document_mask(batch, seq_len) if documents else None
    ours = _run(lambda q, k, v: blocked_causal_attention(q, k, v, allowed), q, k, v, grad)
    reference = _run(_sdpa(allowed, heads != kv_heads), q, k, v, grad, torch.float64)
    for name, error in zip(
        ("out", "dq", "dk", "dv"), _relative_errors(ours, reference), strict=True
    ):
        assert error < 1e-5, (name, error)


def _eager(allowed):
    """Hugging Face's eager attention: bf16 products, softmax in fp32 rounded to bf16."""

    def fn(q, k, v):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        seq_len = q.shape[-2]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        scores = scores.masked_fill(~(causal if allowed is None else allowed), float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    return fn


@pytest.mark.parametrize("case", CASES)
def test_bf16_error_is_that_of_eager_attention(case, kernels):
    """Scores rounded to bf16 before the softmax, as in Hugging Face's eager attention:
    against float64, the output and the three gradients are within 1.25x of the eager
    path's norm-wise error on the same inputs (:func:`_normwise_errors`)."""
    batch, heads, kv_heads, seq_len, head_dim, documents = CASES[case]
    q, k, v, grad = _inputs(batch, heads, kv_heads, seq_len, head_dim, torch.bfloat16)
    allowed = _document_mask(batch, seq_len) if documents else None
    ours = _run(lambda q, k, v: blocked_causal_attention(q, k, v, allowed), q, k, v, grad)
    eager = _run(_eager(allowed), q, k, v, grad)
    reference = _run(_sdpa(allowed, heads != kv_heads), q, k, v, grad, torch.float64)
    ours_errors = _normwise_errors(ours, reference)
    eager_errors = _normwise_errors(eager, reference)
    for name, mine, theirs in zip(
        ("out", "dq", "dk", "dv"), ours_errors, eager_errors, strict=True
    ):
        assert mine <= 1.25 * theirs, (name, mine, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_probabilities_give_the_gradients_of_kept_ones_bit_for_bit(
    dtype, monkeypatch, kernels
):
    q, k, v, grad = _inputs(2, 4, 4, 300, 32, dtype)
    kept = _run(blocked_causal_attention, q, k, v, grad)
    monkeypatch.setattr(attention_module, "KEEP_PROBABILITIES_BYTES", 0)
    recomputed = _run(blocked_causal_attention, q, k, v, grad)
    for a, b in zip(kept, recomputed, strict=True):
        assert torch.equal(a, b)


def _saved_bytes(fn, *args):
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first", [0, 100, -1], ids=["diagonal", "below", "unmasked"])
def test_the_fused_softmax_kernels_match_float64(dtype, first):
    """The fused CPU softmax of a block of causal scores and its backward: each row covers
    the keys up to its query's position (whatever the others hold: here NaN), the rest come
    out 0; within fp32 rounding of the float64 result, rounded once to the dtype."""
    from hlat_model import _native

    lib = _native.load()
    assert lib is not None, _native.unavailable_reason()
    blocks, rows, width = 3, 37, 150  # widths and rows that are not multiples of 16
    scores = (torch.randn(blocks, rows, width) * 4).to(dtype)
    positions = torch.arange(rows)[:, None] + max(first, 0)
    seen = torch.arange(width) <= positions if first >= 0 else torch.ones(rows, width).bool()
    wide = scores.double().masked_fill(~seen, float("-inf")).softmax(-1)
    probs = _native.attention_softmax(lib, scores.masked_fill(~seen, float("nan")), first)
    ulp = 2**-23 if dtype == torch.float32 else 2**-8
    assert (probs.double() - wide).abs().max() <= 4 * ulp * wide.abs().max()
    assert (probs[~seen.expand_as(probs)] == 0).all()

    dprobs = torch.randn(blocks, rows, width).to(dtype)
    p, d = probs.double(), dprobs.double()
    expected = p * (d - (d * p).sum(-1, keepdim=True))
    garbage = dprobs.masked_fill(~seen, float("nan"))
    ours = _native.attention_softmax_backward(lib, garbage, probs, first).double()
    assert (ours - expected).abs().max() <= 8 * ulp * expected.abs().max()
    assert (ours[~seen.expand_as(ours)] == 0).all()


def test_the_fused_add_sums_bf16_into_a_slice_of_an_fp32_tensor():
    from hlat_model import _native

    lib = _native.load()
    assert lib is not None, _native.unavailable_reason()
    acc = torch.randn(4, 50, 8)
    x = torch.randn(4, 30, 8).to(torch.bfloat16)
    expected = acc.clone()
    expected[:, :30] += x.float()
    _native.add_bf16_into_fp32(lib, acc[:, :30], x)
    assert torch.equal(acc, expected)
    with pytest.raises(ValueError, match="dense batches"):
        _native.add_bf16_into_fp32(lib, acc[:, :30], x[:, :20])


def test_bf16_softmax_and_its_backward_compute_in_fp32_and_round_once():
    """What the kernel's bf16 path relies on in torch's CPU kernels: a bf16 softmax gives
    the fp32 softmax of its input rounded to bf16, and its backward the fp32 computation
    from the same bf16 operands rounded (to one unit in the last place)."""
    torch.manual_seed(0)
    scores = (torch.randn(8, 64, 300) * 4).to(torch.bfloat16)
    scores[:, :, 200:] = float("-inf")  # masked keys, as the diagonal block has
    probs = torch.softmax(scores, dim=-1)
    assert probs.dtype == torch.bfloat16
    assert torch.equal(probs, torch.softmax(scores.float(), dim=-1).to(torch.bfloat16))
    dprobs = torch.randn(8, 64, 300).to(torch.bfloat16)
    ours = torch.ops.aten._softmax_backward_data(dprobs, probs, -1, torch.bfloat16)
    wide = torch.ops.aten._softmax_backward_data(dprobs.float(), probs.float(), -1, torch.float32)
    ulp = wide.abs() * 2**-7 + torch.finfo(torch.float32).tiny
    assert ((ours.float() - wide).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_over_the_memory_bound_backward_keeps_only_the_inputs(dtype, monkeypatch):
    """The probabilities are kept in the inputs' dtype (bf16: half the bytes of fp32), up
    to the bound."""
    q, k, v, _ = _inputs(2, 4, 4, 512, 32, dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v))
    probabilities = 2 * 4 * 512 * (512 + query_block(512, q.dtype)) // 2 * q.element_size()
    assert _saved_bytes(blocked_causal_attention, q, k, v) == inputs + probabilities
    monkeypatch.setattr(attention_module, "KEEP_PROBABILITIES_BYTES", probabilities - 1)
    assert _saved_bytes(blocked_causal_attention, q, k, v) == inputs


@pytest.mark.parametrize(
    "seq_len, block",
    [(16, 128), (512, 128), (1024, 128), (1100, 128), (2048, 128), (4096, 256), (8192, 512)],
)
def test_query_blocks_are_multiples_of_64_a_sixteenth_of_the_sequence_and_128_or_more(
    seq_len, block, monkeypatch
):
    assert query_block(seq_len) == block
    assert query_block(seq_len, torch.float32) == block
    monkeypatch.setattr(attention_module, "_cpu_has_amx", lambda: True)
    assert query_block(seq_len, torch.float32) == block
    assert query_block(seq_len, torch.bfloat16) == 2 * block  # bf16 with AMX tiles
    monkeypatch.setattr(attention_module, "_cpu_has_amx", lambda: False)
    assert query_block(seq_len, torch.bfloat16) == block


@pytest.mark.parametrize("amx", [True, False])
def test_bf16_blocks_with_amx_give_the_numbers_of_the_smaller_blocks(amx, monkeypatch):
    """Blocks of 256 (bf16 with AMX) against blocks of 128: the same attention, up to the
    order of the products' sums (norm-wise within 1 % of each other in bf16)."""
    q, k, v, grad = _inputs(2, 4, 2, 600, 32, torch.bfloat16)
    monkeypatch.setattr(attention_module, "_cpu_has_amx", lambda: amx)
    assert attention_module._blocks(600, query_block(600, torch.bfloat16))[0][1] == (
        256 if amx else 128
    )
    ours = _run(blocked_causal_attention, q, k, v, grad)
    monkeypatch.setattr(attention_module, "_cpu_has_amx", lambda: not amx)
    other = _run(blocked_causal_attention, q, k, v, grad)
    for name, error in zip(("out", "dq", "dk", "dv"), _normwise_errors(ours, other), strict=True):
        assert error < 0.01, (name, error)


@pytest.mark.parametrize(
    "backend, device, documents, kernel, form",
    [
        ("auto", "cpu", False, "blocked", "causal"),
        ("auto", "cpu", True, "blocked", "sdpa"),
        ("auto", "cuda", False, "sdpa", "causal"),
        ("auto", "xla", False, "sdpa", "causal"),
        ("sdpa", "cpu", False, "sdpa", "causal"),
        ("sdpa", "cpu", True, "sdpa", "sdpa"),
        ("blocked", "cpu", True, "blocked", "sdpa"),
    ],
)
def test_auto_runs_the_blocked_kernel_on_cpus_only(backend, device, documents, kernel, form):
    doc_lens = torch.tensor([[10, 6]]) if documents else None
    mask = AttentionMask.build(doc_lens, 16, backend, torch.device(device))
    assert (mask.kernel, mask.backend) == (kernel, form)


@pytest.mark.parametrize(
    "amx, seq_len, documents, backend",
    [
        (True, 2048, False, "sdpa"),
        (True, 8192, False, "sdpa"),
        (True, 2047, False, "blocked"),
        (True, 4096, True, "blocked"),  # packed documents: torch's flash kernel takes no mask
        (True, None, False, "blocked"),
        (False, 4096, False, "blocked"),
    ],
)
def test_the_cpu_rule_takes_the_flash_kernel_for_long_sequences_with_amx(
    amx, seq_len, documents, backend
):
    assert cpu_attention_rule(amx, seq_len, documents) == backend


@pytest.mark.parametrize("amx", [True, False])
def test_auto_on_cpus_follows_the_cpu_rule(amx, monkeypatch):
    """The mask a forward builds asks the rule with this CPU's answer (here each answer in
    turn): a long plain-causal sequence runs SDPA with AMX, the blocked kernel without."""
    monkeypatch.setattr(attention_module, "_cpu_has_amx", lambda: amx)
    long = AttentionMask.build(None, SDPA_FROM_TOKENS_WITH_AMX, "auto", torch.device("cpu"))
    short = AttentionMask.build(None, 512, "auto", torch.device("cpu"))
    assert (long.kernel, long.backend) == ("sdpa" if amx else "blocked", "causal")
    assert (short.kernel, short.backend) == ("blocked", "causal")


def test_an_fp32_llama_on_the_fp32_flash_kernel_trains_as_on_torchs(flash_on):
    """Logits and every gradient of a small fp32 model whose attention runs the fp32 flash
    kernel, against SDPA: equal to fp32 rounding (relative to each tensor's largest
    value)."""
    flash_on("fp32")
    torch.manual_seed(0)
    config = dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=128)
    models = {name: Llama(LlamaConfig(**config, attention=name)) for name in ("sdpa", "blocked")}
    models["blocked"].load_state_dict(models["sdpa"].state_dict())
    tokens = torch.randint(0, 256, (2, 129))
    results = {}
    for name, model in models.items():
        logits = model(tokens[:, :-1])
        cross_entropy_loss(logits, tokens[:, 1:]).backward()
        results[name] = [logits.detach()] + [p.grad for p in model.parameters()]
    for ours, theirs in zip(results["blocked"], results["sdpa"], strict=True):
        assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


@pytest.mark.parametrize(
    "kernel, documents",
    [("blocked", False), ("blocked", True), ("bf16-amx", False), ("bf16-avx512bf16", False)],
)
def test_a_bf16_llama_trains_on_blocked_attention_as_on_torchs(kernel, documents, flash_on):
    """Logits and every gradient of a small bf16 model, blocked against SDPA: as close as
    two bf16 runs of different kernels get (relative to each tensor's largest value). With
    a bf16 flash kernel, heads of 32 that it takes (where it runs)."""
    if kernel != "blocked":
        flash_on(kernel)
    torch.manual_seed(0)
    dim = 64 if kernel == "blocked" else 128
    config = dict(vocab_size=256, dim=dim, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=128)
    models = {
        name: Llama(LlamaConfig(**config, attention=name)).to(torch.bfloat16)
        for name in ("sdpa", "blocked")
    }
    models["blocked"].load_state_dict(models["sdpa"].state_dict())
    tokens = torch.randint(0, 256, (2, 129))
    doc_lens = torch.tensor([[50, 78], [128, 0]]) if documents else None
    results = {}
    for name, model in models.items():
        logits = model(tokens[:, :-1], doc_lens=doc_lens)
        cross_entropy_loss(logits, tokens[:, 1:]).backward()
        results[name] = [logits.detach()] + [p.grad for p in model.parameters()]
    for ours, theirs in zip(results["blocked"], results["sdpa"], strict=True):
        scale = theirs.float().abs().max()
        assert (ours.float() - theirs.float()).abs().max() <= 0.03 * scale


def test_backward_makes_no_gradient_for_the_kept_probabilities():
    """The kept probabilities are a second output of the operator; autograd must not build
    a zero gradient as large as they are for it (a fill of megabytes per layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v, _ = _inputs(2, 4, 4, 256, 32, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = blocked_causal_attention(q, k, v)
    kept = sum(
        2 * 4 * (end - start) * end
        for start, end in attention_module._blocks(256, query_block(256, torch.bfloat16))
    )
    made: list[tuple[str, int]] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            made.append((str(func), result.numel() if isinstance(result, torch.Tensor) else 0))
            return result

    with Ops():
        out.sum().backward()
    assert "hlat.blocked_causal_attention_backward.default" in [name for name, _ in made]
    assert kept not in [numel for _, numel in made], made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_code_runs_plain_operators_only_where_the_probabilities_would_be_kept(
    dtype, monkeypatch, traced_targets, kernels
):
    """Where the operator would keep its probabilities, code being compiled gets plain
    operators (which inductor fuses): two products per block; bf16 gets the operator
    instead where the fused CPU kernels run (its softmax is theirs). Above
    :data:`KEEP_PROBABILITIES_BYTES` it gets the operator, whose backward recomputes them."""
    q, k, v, _ = _inputs(2, 4, 2, 300, 32, dtype)
    traced = traced_targets(blocked_causal_attention, q, k, v)
    operator = [t for t in traced if "hlat.blocked_causal_attention" in t]
    if dtype == torch.bfloat16 and kernels == "native":
        assert operator and not any("bmm" in t for t in traced), traced
    else:
        assert not operator, traced
        assert sum("bmm" in t for t in traced) == 2 * len(
            attention_module._blocks(300, query_block(300, dtype))
        )
    monkeypatch.setattr(attention_module, "KEEP_PROBABILITIES_BYTES", 0)
    opaque = traced_targets(blocked_causal_attention, q, k, v)
    assert any("hlat.blocked_causal_attention" in t for t in opaque), opaque
    assert not any("bmm" in t for t in opaque), opaque


def _compiled(allowed):
    return torch.compile(
        lambda q, k, v: blocked_causal_attention(q, k, v, allowed), fullgraph=True, dynamic=False
    )


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize(
    "case, dtype",
    [(case, torch.bfloat16) for case in CASES] + [("gqa-documents-uneven", torch.float32)],
)
def test_compiled_attention_is_as_precise_as_the_operator(case, dtype, kernels):
    """Through inductor (the plain operators or the operator, as the test above says): fp32
    equals SDPA in float64
    to 1e-5; bf16's output and gradients are within 1.25x of Hugging Face's eager
    attention's norm-wise error, as the operator's are."""
    batch, heads, kv_heads, seq_len, head_dim, documents = CASES[case]
    q, k, v, grad = _inputs(batch, heads, kv_heads, seq_len, head_dim, dtype)
    allowed = _document_mask(batch, seq_len) if documents else None
    torch._dynamo.reset()
    try:
        ours = _run(_compiled(allowed), q, k, v, grad)
    finally:
        torch._dynamo.reset()
    reference = _run(_sdpa(allowed, heads != kv_heads), q, k, v, grad, torch.float64)
    errors = _relative_errors(ours, reference)
    if dtype == torch.float32:
        assert max(errors) < 1e-5, errors
        return
    errors = _normwise_errors(ours, reference)
    eager_errors = _normwise_errors(_run(_eager(allowed), q, k, v, grad), reference)
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), errors, eager_errors, strict=True):
        assert mine <= 1.25 * theirs, (name, mine, theirs)


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_attention_keeps_at_most_half_again_the_operators_bytes(monkeypatch):
    """What inductor's backward keeps (the probabilities, and copies of key and value
    prefixes) stays within 1.5x of what the operator keeps (inputs and probabilities)."""
    monkeypatch.setenv("HLAT_MODEL_NATIVE", "0")  # bf16 takes the plain operators
    _native.reset()
    q, k, v, _ = _inputs(4, 8, 8, 512, 64, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    operator = _saved_bytes(blocked_causal_attention, q, k, v)
    torch._dynamo.reset()
    try:
        compiled = _compiled(None)
        compiled(q, k, v)
        composed = _saved_bytes(compiled, q, k, v)
    finally:
        torch._dynamo.reset()
        _native.reset()
    assert composed <= 1.5 * operator, (composed, operator)


# The flash kernels: bf16 on AMX tiles or by AVX512-BF16 dot products, fp32 (AVX-512, AVX2) -

FLASH_CASES = {
    # batch, heads, kv heads, sequence, head dim, scale of q
    "small-heads": (2, 4, 4, 256, 32, 1.0),
    "model-shape": (1, 8, 8, 512, 64, 1.0),
    "gqa": (2, 4, 2, 256, 64, 1.0),
    "wide-heads": (1, 2, 2, 256, 128, 1.0),
    "peaked-softmax": (1, 4, 4, 256, 64, 8.0),
    # the bf16 backward takes the query gradients over bands of 256 keys: three, the last
    # one part of a band
    "uneven-key-bands": (1, 2, 2, 608, 32, 1.0),
}


@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_error_is_that_of_eager_attention(case, flash):
    """Against float64, the output and the three gradients are within 1.25x of Hugging
    Face's eager attention's norm-wise error on the same inputs in bf16 (and under 1 %); in
    fp32 within 2x of it (at most 1.38x on a Xeon with AMX: key and value gradients summed
    block by block) and under 1e-5."""
    *shape, scale = FLASH_CASES[case]
    q, k, v, grad = _inputs(*shape, flash)
    q = (q.float() * scale).to(flash)
    assert attention_module._on_flash_kernel(q, k, v)
    ours = _run(blocked_causal_attention, q, k, v, grad)
    reference = _run(_sdpa(None, shape[1] != shape[2]), q, k, v, grad, torch.float64)
    eager = _normwise_errors(_run(_eager(None), q, k, v, grad), reference)
    factor, bound = (1.25, 0.01) if flash == torch.bfloat16 else (2.0, 1e-5)
    for name, mine, theirs in zip(
        ("out", "dq", "dk", "dv"), _normwise_errors(ours, reference), eager, strict=True
    ):
        assert mine <= factor * theirs and mine < bound, (name, mine, theirs)


def test_flash_runs_where_it_should_and_keeps_only_linear_memory(flash, saved_for_backward):
    """Plain causal attention whose sequence and head size are multiples of 32 runs the
    operator, which keeps q, k, v, the output and one fp32 log-sum-exp per query for
    backward (no probabilities); other shapes, other dtypes and mixed ones keep the blocked
    kernel."""
    q, k, v, _ = _inputs(2, 4, 4, 256, 64, flash)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with saved_for_backward() as saved:
        blocked_causal_attention(q, k, v)
    sizes = sorted(t.numel() * t.element_size() for t in saved)
    assert sizes == sorted([q.numel() * q.element_size()] * 4 + [2 * 4 * 256 * 4])
    for shape in ((2, 4, 300, 64), (2, 4, 256, 48)):
        t = torch.zeros(shape, dtype=flash)
        assert not attention_module._on_flash_kernel(t, t, t)
    assert not attention_module._on_flash_kernel(q.double(), k.double(), v.double())
    other = torch.float32 if flash == torch.bfloat16 else torch.bfloat16
    assert not attention_module._on_flash_kernel(q, k.to(other), v)


@pytest.mark.parametrize("shape", [(2, 8, 2, 256, 64), (1, 6, 3, 320, 32)], ids=["4-per", "2-per"])
def test_flash_reads_grouped_heads_without_copies(shape, flash, saved_for_backward):
    """Grouped key and value heads go to the flash kernels as they are: they keep them at
    their own size for backward; the output and the query gradient are those of the heads
    repeated for each query head bit for bit; the key and value gradients are summed over
    each group's query heads in fp32: in bf16 rounded once, at least as close to float64 as
    the repeated heads' (rounded per head, then summed in bf16 by autograd); in fp32 within
    1e-5 of float64 and of the repeated heads'."""
    q, k, v, grad = _inputs(*shape, flash, seed=3)
    batch, heads, _, seq_len, _ = shape
    group = heads // shape[2]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with saved_for_backward() as saved:
        blocked_causal_attention(*leaves)
    kept = sorted(t.numel() for t in saved)
    assert kept == sorted([k.numel()] * 2 + [q.numel()] * 2 + [batch * heads * seq_len])

    def repeated(q, k, v):
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return torch.ops.hlat.flash_causal_attention(q, k, v)[0]

    ours = _run(blocked_causal_attention, q, k, v, grad)
    theirs = _run(repeated, q, k, v, grad)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    reference = _run(_sdpa(None, True), q, k, v, grad, torch.float64)
    mine, copies = _normwise_errors(ours, reference), _normwise_errors(theirs, reference)
    for name, a, b, x, y in zip(
        ("dk", "dv"), mine[2:], copies[2:], ours[2:], theirs[2:], strict=True
    ):
        if flash == torch.bfloat16:
            assert a <= b, (name, a, b)
        else:
            assert a < 1e-5, (name, a)
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * y.abs().max().item())


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_flash_results_do_not_depend_on_the_thread_count(flash, documents, one_and_many_threads):
    """Each (batch, head) runs whole on one thread: bit for bit the same with 1 thread."""
    q, k, v, grad = _inputs(2, 4, 4, 256, 64, flash)
    lens = _doc_lens([[100, 50, 106], [30, 226]]) if documents else None
    mask = AttentionMask.build(lens, 256, "auto", torch.device("cpu"))
    assert mask.takes_flash

    def attend(q, k, v):
        return attention_module.attention(q, k, v, mask)

    one, many = one_and_many_threads(lambda: _run(attend, q, k, v, grad))
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)


def _doc_lens(rows):
    """[B, D] document lengths, zero padded, of rows of lengths."""
    width = max(map(len, rows))
    return torch.tensor([row + [0] * (width - len(row)) for row in rows])


DOCUMENT_CASES = {
    # batch, heads, kv heads, sequence, head dim, each row's documents (a row they do not fill
    # ends in a trailing segment)
    "boundaries-inside-blocks": (2, 4, 4, 256, 64, [[100, 50, 106], [256]]),
    "tiny-and-block-sized": (1, 4, 2, 320, 32, [[1, 31, 32, 33, 64, 100, 30, 29]]),
    # three bands of the bf16 backward's query gradients; many documents, trailing segments
    "many-and-trailing": (2, 2, 1, 608, 32, [[300, 200], [5] * 60 + [300]]),
    "wide-heads": (1, 2, 2, 512, 128, [[17, 495]]),
}


@pytest.mark.parametrize("case", DOCUMENT_CASES)
def test_flash_with_packed_documents_is_as_precise_as_eager_attention(
    case, flash, saved_for_backward
):
    """``auto`` on a CPU whose flash kernel runs gives it packed documents too (each query's
    first key, :func:`document_first_keys`): it keeps one log-sum-exp per query, no
    probabilities, and against float64 with the block-diagonal mask its output and
    gradients are within 1.25x of Hugging Face's eager attention's norm-wise error in bf16
    (and under 1 %), under 1e-5 in fp32."""
    *shape, rows = DOCUMENT_CASES[case]
    batch, heads, kv_heads, seq_len, _ = shape
    lens = _doc_lens(rows).expand(batch, -1) if len(rows) == 1 else _doc_lens(rows)
    mask = AttentionMask.build(lens, seq_len, "auto", torch.device("cpu"))
    assert mask.takes_flash
    assert torch.equal(mask.first, document_first_keys(lens, seq_len))
    q, k, v, grad = _inputs(*shape, flash)
    assert attention_module._on_flash_kernel(q, k, v)

    def attend(q, k, v):
        return attention_module.attention(q, k, v, mask)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with saved_for_backward() as saved:
        attend(*leaves)
    assert any(t.dtype == torch.float32 and t.shape == (batch * heads, seq_len) for t in saved)
    assert not any(t.dim() == 4 and t.shape[-1] == seq_len for t in saved)  # no probabilities
    ours = _run(attend, q, k, v, grad)
    reference = _run(_sdpa(mask.mask, heads != kv_heads), q, k, v, grad, torch.float64)
    eager = _normwise_errors(_run(_eager(mask.mask), q, k, v, grad), reference)
    factor, bound = (1.25, 0.01) if flash == torch.bfloat16 else (2.0, 1e-5)
    for name, mine, theirs in zip(
        ("out", "dq", "dk", "dv"), _normwise_errors(ours, reference), eager, strict=True
    ):
        assert mine <= factor * theirs and mine < bound, (name, mine, theirs)


def test_flash_keeps_each_packed_document_to_itself(flash):
    """New queries, keys, values and output gradients for one document leave every other
    document's output and gradients bit for bit as they were: its keys are hidden from them
    (their probabilities exactly 0), not merely outweighed."""
    seq_len, changed_rows = 256, slice(40, 110)  # document 1 of row 0
    mask = AttentionMask.build(
        _doc_lens([[40, 70, 50, 96], [256]]), seq_len, "auto", torch.device("cpu")
    )
    assert mask.takes_flash
    before = _inputs(2, 4, 2, seq_len, 64, flash)
    after = [t.clone() for t in before]
    generator = torch.Generator().manual_seed(5)
    for t in after:
        t[0, :, changed_rows] = torch.randn(t[0, :, changed_rows].shape, generator=generator)

    def attend(q, k, v):
        return attention_module.attention(q, k, v, mask)

    kept = torch.ones(seq_len, dtype=torch.bool)
    kept[changed_rows] = False
    for a, b in zip(_run(attend, *before), _run(attend, *after), strict=True):
        assert torch.equal(a[0][:, kept], b[0][:, kept]) and torch.equal(a[1], b[1])
        assert not torch.equal(a[0][:, ~kept], b[0][:, ~kept])


def test_one_row_of_documents_serves_every_batch_row(flash):
    """``doc_lens`` of one row for a batch of several (its mask broadcasts over the batch):
    the flash kernel reads the same first keys for every row."""
    q, k, v, grad = _inputs(3, 2, 2, 128, 32, flash)
    one = AttentionMask.build(_doc_lens([[50, 78]]), 128, "auto", torch.device("cpu"))
    every = AttentionMask.build(_doc_lens([[50, 78]] * 3), 128, "auto", torch.device("cpu"))
    assert one.first.shape == (1, 128)
    for a, b in zip(
        _run(lambda q, k, v: attention_module.attention(q, k, v, one), q, k, v, grad),
        _run(lambda q, k, v: attention_module.attention(q, k, v, every), q, k, v, grad),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_only_auto_on_a_flash_cpu_gives_packed_documents_first_keys(flash):
    lens = _doc_lens([[10, 22]])
    assert AttentionMask.build(lens, 32, "auto", torch.device("cpu")).takes_flash
    for asked in ("blocked", "sdpa"):
        mask = AttentionMask.build(lens, 32, asked, torch.device("cpu"))
        assert not mask.takes_flash and mask.first is None
    assert document_first_keys(lens, 32).tolist() == [[0] * 10 + [10] * 22]


def test_flash_takes_a_strided_output_gradient(flash):
    """The output's gradient as the output projection's backward lays it out ([B, S, H, D]
    memory) or with rows apart: the same gradients as from a contiguous one."""
    q, k, v, grad = _inputs(2, 4, 4, 128, 64, flash)
    dense = _run(blocked_causal_attention, q, k, v, grad)
    as_projection = grad.transpose(1, 2).contiguous().transpose(1, 2)
    padded = torch.zeros(2, 4, 128, 96, dtype=flash)
    padded[..., :64] = grad
    for strided in (as_projection, padded[..., :64]):
        assert not strided.is_contiguous()
        for a, b in zip(_run(blocked_causal_attention, q, k, v, strided), dense, strict=True):
            assert torch.equal(a, b)


def test_flash_operator_passes_torchs_checks(flash):
    # also with grouped key and value heads, which the kernels read as they are, and with
    # packed documents' first keys
    first = document_first_keys(_doc_lens([[20, 44]]), 64)
    for kv_heads, documents in ((2, None), (1, None), (2, first)):
        q, k, v, _ = _inputs(1, 2, kv_heads, 64, 32, flash)
        args = (*(t.requires_grad_() for t in (q, k, v)), documents)
        torch.library.opcheck(torch.ops.hlat.flash_causal_attention.default, args)


@pytest.mark.compile
def test_compiled_code_calls_the_flash_operator(flash, traced_targets):
    q, k, v, _ = _inputs(1, 2, 2, 64, 32, flash)
    assert "hlat.flash_causal_attention" in traced_targets(blocked_causal_attention, q, k, v)
    compiled = torch.compile(blocked_causal_attention, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), blocked_causal_attention(q, k, v))
    # packed documents: the operator with the first keys, forward and backward
    mask = AttentionMask.build(_doc_lens([[20, 44]]), 64, "auto", torch.device("cpu"))

    def attend(q, k, v):
        return attention_module.attention(q, k, v, mask)

    assert "hlat.flash_causal_attention" in traced_targets(attend, q, k, v)
    grad = torch.randn(q.shape).to(flash)
    torch._dynamo.reset()
    try:
        ours = _run(torch.compile(attend, fullgraph=True), q, k, v, grad)
    finally:
        torch._dynamo.reset()
    for a, b in zip(ours, _run(attend, q, k, v, grad), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("asked, runs", [("auto", True), ("sdpa", False), ("blocked", True)])
def test_auto_takes_a_flash_kernel_over_torchs_for_long_sequences(
    asked, runs, flash, monkeypatch, saved_for_backward
):
    """On a CPU with AMX, ``auto``'s rule picks torch's flash kernel from 2,048 tokens; the
    fused kernels' flash attention takes those sequences over where it runs (multiples of
    32), while an explicit ``sdpa`` keeps torch's kernel."""
    monkeypatch.setattr(attention_module, "_cpu_has_amx", lambda: True)
    seq_len = SDPA_FROM_TOKENS_WITH_AMX
    mask = AttentionMask.build(None, seq_len, asked, torch.device("cpu"))
    assert mask.flash == (asked == "auto")
    q, k, v, _ = _inputs(1, 2, 2, seq_len, 32, flash)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with saved_for_backward() as saved:
        attention_module.attention(q, k, v, mask)
    lse = [t for t in saved if t.dtype == torch.float32 and t.shape == (2, seq_len)]
    assert bool(lse) == runs


def test_flash_attention_says_why_it_does_not_run(monkeypatch):
    off = "turned off by HLAT_MODEL_FLASH_ATTENTION=0"
    reasons = (amx_attention_reason, bf16_flash_attention_reason, fp32_flash_attention_reason)
    assert [reason() for reason in reasons] == [off] * 3
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.zeros(1, 1, FLASH_BLOCK, FLASH_BLOCK, dtype=dtype)
        assert not attention_module._on_flash_kernel(q, q, q)
    monkeypatch.delenv("HLAT_MODEL_FLASH_ATTENTION")
    monkeypatch.setenv("HLAT_MODEL_AMX_ATTENTION", "0")  # the AMX tiles' own switch
    assert amx_attention_reason() == "turned off by HLAT_MODEL_AMX_ATTENTION=0"
    assert fp32_flash_attention_reason() == _FP32_FLASH
    monkeypatch.delenv("HLAT_MODEL_AMX_ATTENTION")
    monkeypatch.setenv("HLAT_MODEL_NATIVE", "0")
    _native.reset()
    try:
        for reason in reasons:
            assert reason().startswith("no fused CPU kernels (turned off by")
    finally:
        _native.reset()
    monkeypatch.delenv("HLAT_MODEL_NATIVE")
    if _native.load() is not None:
        for ready in ("amx_attention_ready", "bf16_attention_ready", "f32_attention_ready"):
            monkeypatch.setattr(_native, ready, lambda lib: False)
        monkeypatch.setattr(attention_module, "_cpu_has_amx", lambda: False)
        assert amx_attention_reason() == "this CPU has no AMX tiles"
        monkeypatch.setattr(attention_module, "cpu_has_native_bf16", lambda: False)
        assert bf16_flash_attention_reason().startswith("bf16 products are emulated here")
        monkeypatch.setattr(attention_module, "cpu_has_native_bf16", lambda: True)
        assert "without AVX512-BF16" in bf16_flash_attention_reason()
        # AMX tiles the kernels can use, but bf16 emulated (oneDNN held below bf16): the
        # attention runs in fp32, so no bf16 kernel runs
        monkeypatch.setattr(_native, "amx_attention_ready", lambda lib: True)
        assert amx_attention_reason() is None
        monkeypatch.setattr(attention_module, "cpu_has_native_bf16", lambda: False)
        assert bf16_flash_attention_reason().startswith("bf16 products are emulated here")
        assert "without AVX-512F or AVX2" in fp32_flash_attention_reason()


def test_flash_refuses_first_keys_that_are_not_document_starts(flash):
    q, k, v, _ = _inputs(1, 2, 2, 64, 32, flash)
    good = document_first_keys(_doc_lens([[20, 44]]), 64)
    later = good.clone()
    later[0, 5] = 6  # after its own position
    falling = good.clone()
    falling[0, 40] = 0  # before the previous query's
    for bad in (good - 1, later, falling, good.to(torch.int32)[:, :32]):
        with pytest.raises(ValueError, match="first keys must"):
            _native.flash_attention_forward(_native.load(), q, k, v, first=bad)
