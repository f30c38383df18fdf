"""The head split, RoPE and the bf16 flash attention in one kernel (``rope_flash_attention``)
against the two steps it replaces and against float64, and when the model takes it. The tests
of the kernel run on AMX tiles and by AVX512-BF16 dot products (the ``bf16_flash`` fixture),
each skipped where it cannot run, saying why; those of when it runs run anywhere."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hlat_model import Llama, LlamaConfig
from hlat_model import model as model_module
from hlat_model.attention import (
    AttentionMask,
    bf16_flash_attention_reason,
    blocked_causal_attention,
    rope_flash_attention,
    rope_flash_attention_fits,
)
from hlat_model.model import _HeadsWithRope, apply_rope, rope_cos_sin

_BF16_FLASH = bf16_flash_attention_reason()

CASES = {
    # batch, sequence, key and value heads, query heads per key head, head dim, rows starting
    # at other positions
    "model-shape": (2, 512, 8, 1, 64, False),
    "small-heads": (2, 96, 3, 1, 32, False),
    "wide-heads": (1, 64, 2, 1, 128, False),
    "positions-per-row": (2, 128, 2, 1, 64, True),
    # backward takes the query gradients over bands of 256 keys: two, the second short
    "uneven-key-bands": (1, 288, 2, 1, 32, False),
    # grouped-query heads: 4 and 2 query heads per key and value head
    "grouped-heads": (2, 128, 2, 4, 64, False),
    "grouped-heads-positions-per-row": (2, 288, 3, 2, 32, True),
}


def _inputs(batch, seq_len, groups, per_group, head_dim, per_row, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, seq_len, groups, per_group + 2, head_dim)
    qkv = torch.randn(shape, generator=generator).bfloat16()
    positions = torch.arange(seq_len)[None]
    if per_row:
        positions = positions + 5 * torch.arange(batch)[:, None]
    cos, sin = rope_cos_sin(positions, head_dim, 10000.0)
    heads = groups * per_group
    grad = torch.randn(batch, heads, seq_len, head_dim, generator=generator).bfloat16()
    return qkv, cos, sin, grad


def _two_steps(qkv, cos, sin):
    """What the model ran before: the fused RoPE head split, then the flash attention."""
    return blocked_causal_attention(*_HeadsWithRope.apply(qkv, cos, sin))


def _exact(qkv, cos, sin):
    """The same function in float64: RoPE, then causal SDPA (each group's key and value
    head repeated for its query heads)."""
    per_group = qkv.shape[3] - 2
    q, k, v = qkv[:, :, :, :per_group].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
    q, k = apply_rope(q, cos.double(), sin.double()), apply_rope(k, cos.double(), sin.double())
    k, v = (t.repeat_interleave(per_group, 2) for t in (k, v))
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)


def _run(fn, qkv, cos, sin, grad, dtype=torch.bfloat16):
    x = qkv.to(dtype, copy=True).requires_grad_()
    out = fn(x, cos, sin)
    out.backward(grad.to(dtype))
    return out.detach(), x.grad


def _error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return ((ours.double() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("case", CASES)
def test_the_numbers_of_the_two_steps_and_as_close_to_float64(case, bf16_flash):
    """Forward: the two steps' output bit for bit (the same rotation, rounded once, then the
    same kernel). Backward: the value gradient bit for bit with one query head per key head;
    the query and key gradients, rotated back from their fp32 sums and rounded once (the two
    steps round twice), and with grouped heads the key and value gradients, summed over the
    group in fp32 and rounded once (the two steps round each head's, then their sum), within
    bf16 roundings of the two steps' and at least as close to float64."""
    qkv, cos, sin, grad = _inputs(*CASES[case])
    per_group = CASES[case][3]
    out, dqkv = _run(rope_flash_attention, qkv, cos, sin, grad)
    two_out, two_dqkv = _run(_two_steps, qkv, cos, sin, grad)
    exact_out, exact_dqkv = _run(_exact, qkv, cos, sin, grad, torch.float64)
    assert out.shape == two_out.shape and out.dtype == torch.bfloat16
    assert torch.equal(out, two_out)
    rounded_once = {"q": slice(0, per_group), "k": per_group}
    if per_group == 1:
        assert torch.equal(dqkv[:, :, :, -1], two_dqkv[:, :, :, -1])
    else:
        rounded_once["v"] = per_group + 1
    for part, at in rounded_once.items():
        ours, theirs, exact = dqkv[:, :, :, at], two_dqkv[:, :, :, at], exact_dqkv[:, :, :, at]
        rtol = 2**-7 * per_group  # a group's sum: one rounding of each head's gradient
        torch.testing.assert_close(ours, theirs, rtol=rtol, atol=rtol * theirs.abs().max())
        assert _error(ours, exact) <= _error(theirs, exact) * 1.001, part
    assert _error(out, exact_out) < 0.01


def test_the_results_do_not_depend_on_the_thread_count(one_and_many_threads, bf16_flash):
    """Each (batch, head) runs whole on one thread: bit for bit the same with 1 thread."""
    qkv, cos, sin, grad = _inputs(2, 128, 2, 2, 64, True)
    one, many = one_and_many_threads(lambda: _run(rope_flash_attention, qkv, cos, sin, grad))
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)


def test_it_fits_plain_causal_bf16_attention_of_whole_blocks_only(monkeypatch):
    """Where the bf16 flash attention runs, plain causal bf16 attention (grouped heads too),
    sequence and head size multiples of 32, with the model's tables: yes; fp32, other sizes,
    packed documents, a mask ``auto`` did not give the flash kernels, a non-contiguous
    product or tables of another layout: no. Elsewhere never."""
    qkv, cos, sin, _ = _inputs(2, 64, 2, 1, 32, False)
    flash = AttentionMask("causal", kernel="blocked", flash=True)
    grouped = torch.zeros(2, 64, 1, 4, 32, dtype=torch.bfloat16)  # 2 query heads per group
    for fits in (qkv, grouped):
        assert rope_flash_attention_fits(fits, cos, sin, flash) == (_BF16_FLASH is None)
    short = torch.zeros(2, 48, 2, 3, 32, dtype=torch.bfloat16)
    narrow = torch.zeros(2, 64, 2, 3, 48, dtype=torch.bfloat16)
    narrow_tables = rope_cos_sin(torch.arange(64)[None], 48, 10000.0)
    for args in (
        (qkv.float(), cos, sin, flash),
        (short, *rope_cos_sin(torch.arange(48)[None], 32, 10000.0), flash),
        (narrow, *narrow_tables, flash),
        (qkv, cos, sin, AttentionMask("causal", kernel="blocked", flash=False)),
        (qkv, cos, sin, AttentionMask("sdpa", mask=torch.ones(2, 1, 64, 64, dtype=torch.bool))),
        (qkv.transpose(-1, -2).contiguous().transpose(-1, -2), cos, sin, flash),
        (qkv, cos.double(), sin.double(), flash),
    ):
        assert not rope_flash_attention_fits(*args)
    monkeypatch.setenv("HLAT_MODEL_FLASH_ATTENTION", "0")
    assert not rope_flash_attention_fits(qkv, cos, sin, flash)


def _graph_names(tensor: torch.Tensor) -> set[str]:
    """The class names of every node of the autograd graph that computed ``tensor``."""
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


def _step(
    config: LlamaConfig, fused: bool, monkeypatch, doc_lens: torch.Tensor | None = None
) -> tuple[torch.Tensor, list, set]:
    with monkeypatch.context() as patched:  # undoes only its own patch
        if not fused:
            patched.setattr(model_module, "rope_flash_attention_fits", lambda *args: False)
        torch.manual_seed(0)
        model = Llama(config).to(torch.bfloat16)
        tokens = torch.randint(0, config.vocab_size, (2, 65))
        loss = model(tokens[:, :-1], doc_lens=doc_lens, labels=tokens[:, 1:])
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], _graph_names(loss)


@pytest.mark.parametrize(
    "sequence_first, kv_heads", [(False, 2), (True, 2), (False, 1)], ids=["bsh", "sbh", "gqa"]
)
def test_the_model_takes_it_with_the_same_loss(sequence_first, kv_heads, bf16_flash, monkeypatch):
    """A bf16 Llama on a CPU whose bf16 flash attention runs takes its attention through the
    fused kernel (batch-first, sequence-first, grouped heads): the loss of the two steps bit
    for bit, and gradients within bf16 roundings of theirs."""
    config = LlamaConfig(
        vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=kv_heads, ffn_dim=256,
        max_seq_len=64, sequence_first=sequence_first,
    )  # fmt: skip
    loss, grads, names = _step(config, True, monkeypatch)
    two_loss, two_grads, two_names = _step(config, False, monkeypatch)
    assert "_RopeFlashAttentionBackward" in names
    assert "_RopeFlashAttentionBackward" not in two_names and "_HeadsWithRopeBackward" in two_names
    assert torch.equal(loss, two_loss)
    for ours, theirs in zip(grads, two_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0.02, atol=0.02 * theirs.abs().max())


def test_packed_documents_take_it_with_the_same_loss(bf16_flash, monkeypatch):
    """With packed documents (positions restarting per document, each query's first key),
    the model takes the fused kernel too: the loss of the two steps bit for bit, gradients
    within bf16 roundings, and a loss other than plain causal attention's."""
    config = LlamaConfig(
        vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256,
        max_seq_len=64,
    )  # fmt: skip
    doc_lens = torch.tensor([[20, 30, 14], [64, 0, 0]])
    loss, grads, names = _step(config, True, monkeypatch, doc_lens)
    two_loss, two_grads, two_names = _step(config, False, monkeypatch, doc_lens)
    causal, _, _ = _step(config, True, monkeypatch)
    assert "_RopeFlashAttentionBackward" in names
    assert "_RopeFlashAttentionBackward" not in two_names
    assert torch.equal(loss, two_loss) and not torch.equal(loss, causal)
    for ours, theirs in zip(grads, two_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0.02, atol=0.02 * theirs.abs().max())


@pytest.mark.parametrize("sequence_first", [False, True], ids=["bsh", "sbh"])
def test_selective_checkpointing_takes_it_batch_first(sequence_first, bf16_flash, monkeypatch):
    """Selective checkpointing does not recompute a flash kernel whose output is the output
    projection's input (batch-first), so the fused kernel runs there as without
    checkpointing, with the same loss; sequence-first, whose output is copied for the
    projection, keeps the two steps and recomputes the attention."""
    config = LlamaConfig(
        vocab_size=256, dim=128, n_layers=1, n_heads=2, ffn_dim=256, max_seq_len=64,
        checkpointing="selective", sequence_first=sequence_first,
    )  # fmt: skip
    loss, _, names = _step(config, True, monkeypatch)
    plain, _, plain_names = _step(replace(config, checkpointing="none"), True, monkeypatch)
    assert "_RopeFlashAttentionBackward" in plain_names
    assert ("_RopeFlashAttentionBackward" in names) is not sequence_first
    assert ("_HeadsWithRopeBackward" in names) is sequence_first
    assert torch.equal(loss, plain)
