"""The LM head and the loss fused (``linear_cross_entropy``, ``Llama(..., labels=...)``)
against the head's product into logits and ``F.cross_entropy`` on them."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from hlat_model import Llama, LlamaConfig, cross_entropy_loss, linear_cross_entropy
from hlat_model import loss as loss_module


def _reference(hidden, weight, labels, ignore_index=-100, scale=1.0):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    logits = F.linear(hidden, weight).flatten(0, -2)
    value = F.cross_entropy(logits, labels.flatten(), ignore_index=ignore_index)
    (scale * value).backward()
    return value.detach(), hidden.grad, weight.grad


def _assert_same_up_to_sum_order(actual, expected):
    """Equal up to the order of fp32 sums: each element within 1e-5 of itself, or within
    1e-6 of the tensor's largest element, where a sum cancels to near zero (an element of
    2e-5 in a gradient whose largest is about 0.1 differed by 1e-8 on an AVX-512 CPU)."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


@pytest.fixture(params=["one chunk", "uneven chunks"])
def chunking(request, monkeypatch):
    if request.param == "uneven chunks":
        # 7 rows per chunk: 30 rows make 4 full chunks and one of 2
        monkeypatch.setitem(loss_module.FUSED_HEAD_ROWS, "cpu", 7)
    return request.param


@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_value_and_gradients_are_those_through_the_logits(kernels, chunking, ignore_index):
    hidden = torch.randn(3, 10, 32, requires_grad=True)
    weight = (torch.randn(300, 32) / 4).requires_grad_()
    labels = torch.randint(0, 300, (3, 10))
    labels[0, :4] = ignore_index
    labels[2, 7] = ignore_index
    assert loss_module.fuses_head(hidden, weight)
    value = linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index)
    (3.5 * value).backward()
    expected, grad_hidden, grad_weight = _reference(hidden, weight, labels, ignore_index, 3.5)
    assert value.dtype == torch.float32 and value.dim() == 0
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)
    _assert_same_up_to_sum_order(hidden.grad, grad_hidden)
    _assert_same_up_to_sum_order(weight.grad, grad_weight)
    assert hidden.grad[0, :4].abs().max() == 0  # ignored positions get no gradient


def test_a_frozen_head_gets_no_gradient_and_the_input_gets_its_own():
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(50, 16)  # a frozen head: a plain tensor without grad
    labels = torch.randint(0, 50, (2, 9))
    linear_cross_entropy(hidden, weight, labels).backward()
    _, grad_hidden, _ = _reference(hidden, weight, labels)
    _assert_same_up_to_sum_order(hidden.grad, grad_hidden)


def test_keeps_no_logits_for_backward_and_makes_none_without_grad(monkeypatch, saved_for_backward):
    """What autograd keeps is the size of the head's input and weight, nothing the size of
    the logits; without gradients the value is the same."""
    monkeypatch.setitem(loss_module.FUSED_HEAD_ROWS, "cpu", 16)
    hidden = torch.randn(4, 64, 32, requires_grad=True)
    weight = torch.randn(512, 32, requires_grad=True)
    labels = torch.randint(0, 512, (4, 64))
    with saved_for_backward() as saved:
        value = linear_cross_entropy(hidden, weight, labels)
    assert sorted(t.numel() for t in saved) == [hidden.numel(), weight.numel()]
    with torch.no_grad():
        again = linear_cross_entropy(hidden, weight, labels)
    assert torch.equal(value.detach(), again)

    with saved_for_backward() as saved:
        cross_entropy_loss(F.linear(hidden, weight), labels)
    assert any(t.numel() == 4 * 64 * 512 for t in saved)  # the logits, kept by the other path


def test_bf16_fuses_where_linear_multiplies_bf16_natively():
    """bf16 is fused where ``Linear`` takes oneDNN's bf16 products (CPUs with AVX512-BF16 or
    AMX), and keeps the logits where it takes its fp32-accumulating path instead."""
    from hlat_model.linear import cpu_has_native_bf16, linear

    hidden = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    weight = torch.randn(100, 32, dtype=torch.bfloat16)
    labels = torch.randint(0, 100, (2, 8))
    assert loss_module.fuses_head(hidden, weight) == cpu_has_native_bf16()
    assert loss_module.fuses_head(hidden.float(), weight.float())
    assert not loss_module.fuses_head(hidden, weight.float())
    expected = cross_entropy_loss(linear(hidden, weight), labels)
    torch.testing.assert_close(
        linear_cross_entropy(hidden, weight, labels), expected, rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_bf16_fused_rounds_as_the_path_through_the_logits(
    kernels, chunking, ignore_index, monkeypatch
):
    """The fused bf16 path (taken here whatever this CPU, its products emulated where the
    CPU lacks bf16 instructions) against the bf16 logits path and float64: the same loss,
    the input's gradient as close to float64 (each chunk's logits' gradient is rounded once,
    as the loss's backward rounds it), the weight's within 1.5x (its sum over chunks is
    rounded once per chunk: 1.25x at most over 20 inputs of 120 rows in 3 chunks)."""
    from hlat_model import linear as linear_module

    monkeypatch.setattr(linear_module, "_CPU_HAS_NATIVE_BF16", True)
    torch.manual_seed(3)
    hidden = torch.randn(3, 10, 32).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(300, 32) / 4).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 300, (3, 10))
    labels[0, :4] = ignore_index
    labels[2, 7] = ignore_index
    assert loss_module.fuses_head(hidden, weight)
    value = linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index)
    value.backward()
    fused = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    through_logits = cross_entropy_loss(
        linear_module.linear(hidden, weight), labels, ignore_index=ignore_index
    )
    through_logits.backward()
    expected = _reference(hidden.double(), weight.double(), labels, ignore_index)
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, through_logits, rtol=1e-6, atol=0)
    torch.testing.assert_close(value.double(), expected[0], rtol=1e-3, atol=0)

    def error(grad, reference):
        return ((grad.double() - reference).norm() / reference.norm()).item()

    assert fused[0].dtype == fused[1].dtype == torch.bfloat16
    assert error(fused[0], expected[1]) <= 1.02 * error(hidden.grad, expected[1])
    assert error(fused[1], expected[2]) <= 1.5 * error(weight.grad, expected[2])
    assert error(fused[1], expected[2]) < 1e-2
    assert fused[0][0, :4].abs().max() == 0  # ignored positions get no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_positions_ignored_gives_nan_and_zero_gradients_as_f_cross_entropy_does(kernels, dtype):
    hidden = torch.randn(1, 3, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(20, 8, dtype=dtype, requires_grad=True)
    labels = torch.full((1, 3), -100)
    value = linear_cross_entropy(hidden, weight, labels)
    assert value.isnan()
    value.backward()
    expected, expected_hidden, expected_weight = _reference(hidden, weight, labels)
    assert expected.isnan()
    assert not expected_hidden.any() and not expected_weight.any()  # zeros
    torch.testing.assert_close(hidden.grad, expected_hidden, rtol=0, atol=0)
    torch.testing.assert_close(weight.grad, expected_weight, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fused", "logits"])
def test_bad_shapes_and_labels_are_refused_before_any_work(dtype):
    hidden, weight = torch.randn(2, 5, 16, dtype=dtype), torch.randn(40, 16, dtype=dtype)
    with pytest.raises(ValueError, match=r"hidden of shape \(2, 5, 16\) does not fit .*\(40, 8\)"):
        linear_cross_entropy(hidden, weight[:, :8], torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels of shape \(2, 4\) do not match.*\(2, 5\)"):
        linear_cross_entropy(hidden, weight, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"integer token ids, got torch\.float32"):
        linear_cross_entropy(hidden, weight, torch.zeros(2, 5))


@pytest.mark.parametrize(
    "change",
    [{}, {"tie_embeddings": True}, {"sequence_first": True}],
    ids=["untied", "tied", "sequence-first"],
)
def test_the_model_with_labels_gives_the_loss_of_its_logits(change, monkeypatch):
    monkeypatch.setitem(loss_module.FUSED_HEAD_ROWS, "cpu", 24)  # 64 rows: 3 chunks
    config = dataclasses.replace(LlamaConfig.preset("tiny"), **change)
    model = Llama(config)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    labels = torch.randint(0, config.vocab_size, (2, 32))
    labels[1, :3] = -100
    expected = cross_entropy_loss(model(ids), labels)
    expected.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    value = model(ids, labels=labels)
    value.backward()
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_a_head_with_hooks_goes_through_its_module():
    """Forward hooks on the head (an observer, a wrapper's hook) still see its logits."""
    config = LlamaConfig.preset("tiny")
    model = Llama(config)
    seen: list[tuple[int, ...]] = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.randint(0, config.vocab_size, (2, 16))
    value = model(ids, labels=labels)
    assert seen == [(2, 16, config.vocab_size)]
    torch.testing.assert_close(value, cross_entropy_loss(model(ids), labels))


class _Adapted(torch.nn.Module):
    """A low-rank adapter around a head, exposing the head's weight as its own."""

    def __init__(self, base: torch.nn.Module, rank: int = 4):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features) / 8)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, rank) / 8)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T) @ self.b.T


@pytest.mark.parametrize("head", ["biased nn.Linear", "adapter"])
def test_a_replaced_or_wrapped_head_goes_through_its_module(head):
    """Only hlat's own unhooked ``Linear`` head is fused with the loss: another module in its
    place (one with a bias, an adapter around it) gives the loss of its logits, and its own
    parameters get their gradients."""
    config = LlamaConfig.preset("tiny", n_layers=1)
    model = Llama(config)
    if head == "adapter":
        model.lm_head = _Adapted(model.lm_head)
        extra = ["a", "b"]
    else:
        model.lm_head = torch.nn.Linear(config.dim, config.vocab_size)
        torch.nn.init.normal_(model.lm_head.bias)
        extra = ["bias"]
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.randint(0, config.vocab_size, (2, 16))
    value = model(ids, labels=labels)
    value.backward()
    torch.testing.assert_close(value, cross_entropy_loss(model(ids), labels))
    params = dict(model.lm_head.named_parameters())
    for name in extra:
        assert params[name].grad is not None and params[name].grad.abs().max() > 0, name


def test_the_model_computes_its_loss_with_its_loss_fn():
    """``Llama.loss_fn`` is what the model's loss is computed with: another trainer's own
    loss gets the logits (the fused head and loss, cross entropy's, are bypassed), and the
    default (or a wrapper of it, such as its compiled form) keeps the fused path."""
    config = LlamaConfig.preset("tiny")
    model = Llama(config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.randint(0, config.vocab_size, (2, 16))
    seen: list[tuple[int, ...]] = []

    def z_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(logits.shape))
        return cross_entropy_loss(logits, labels) + 1e-4 * logits.logsumexp(-1).square().mean()

    assert model.loss_fn is cross_entropy_loss
    plain = model(ids, labels=labels)
    model.loss_fn = z_loss
    value = model(ids, labels=labels)
    assert seen == [(2, 16, config.vocab_size)]
    logits = model(ids)
    torch.testing.assert_close(value, z_loss(logits, labels))
    assert value > plain

    @functools.wraps(cross_entropy_loss)
    def smoothed(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(logits.shape))
        return 0.9 * cross_entropy_loss(logits, labels) - 0.1 * logits.log_softmax(-1).mean()

    # a wrapper through functools.wraps may compute another loss: it gets the logits
    seen.clear()
    model.loss_fn = smoothed
    torch.testing.assert_close(model(ids, labels=labels), smoothed(model(ids), labels))
    assert seen[0] == (2, 16, config.vocab_size)

    @functools.wraps(cross_entropy_loss)
    def compiled(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(logits.shape))
        return cross_entropy_loss(logits, labels)

    compiled.hlat_compiled = True  # type: ignore[attr-defined]  # as compile_blocks marks it
    seen.clear()
    model.loss_fn = compiled
    torch.testing.assert_close(model(ids, labels=labels), plain)
    assert seen == []  # fp32 on a CPU: the head and the loss fused, no logits made


def test_another_loss_gets_batch_first_logits_and_labels_with_sequence_first():
    config = LlamaConfig.preset("tiny", n_layers=2)
    batch_first = Llama(config)
    sequence_first = Llama(dataclasses.replace(config, sequence_first=True))
    sequence_first.load_state_dict(batch_first.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.randint(0, config.vocab_size, (2, 16))
    labels[1, :5] = -100
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def row_weighted(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each row's mean loss, rows weighted 1, 2, ...: the layout matters."""
        seen.append((tuple(logits.shape), tuple(labels.shape)))
        terms = F.cross_entropy(logits.transpose(1, 2).float(), labels, reduction="none")
        valid = labels != -100
        per_row = (terms * valid).sum(1) / valid.sum(1)
        return (per_row * torch.arange(1, len(per_row) + 1)).sum()

    batch_first.loss_fn = sequence_first.loss_fn = row_weighted
    expected = batch_first(ids, labels=labels)
    value = sequence_first(ids, labels=labels)
    assert seen == [((2, 16, config.vocab_size), (2, 16))] * 2
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5)


def test_the_model_refuses_labels_that_do_not_fit_before_running():
    config = LlamaConfig.preset("tiny")
    model = Llama(config)
    calls: list[int] = []
    model.embed_tokens.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with pytest.raises(ValueError, match=r"shape of input_ids \(2, 16\), got torch.int64 of"):
        model(ids, labels=ids[:, :-1])
    with pytest.raises(TypeError, match=r"integer token ids .* got torch.float32"):
        model(ids, labels=ids.float())
    assert calls == []


def test_positions_and_document_lengths_of_the_wrong_shape_are_refused_before_running():
    config = LlamaConfig.preset("tiny")
    model = Llama(config)
    calls: list[int] = []
    model.embed_tokens.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, config.vocab_size, (2, 16))
    lens = torch.tensor([[10, 6], [16, 0]])
    for kwargs, needle in (
        ({"doc_lens": lens[0]}, r"doc_lens must be integer .* batch 2.* shape \(2,\)"),
        ({"doc_lens": lens[None]}, r"doc_lens .* got torch.int64 of shape \(1, 2, 2\)"),
        ({"doc_lens": lens.float()}, r"doc_lens .* got torch.float32"),
        ({"doc_lens": torch.tensor([[10, 6], [20, -4]])}, r"non-negative .* \[20, -4\] in row 1"),
        # the lengths of unshifted rows (one token more than the model is given)
        ({"doc_lens": torch.tensor([[9, 8], [17, 0]])}, r"summing to at most .* 16, got \[9, 8\]"),
        ({"doc_lens": lens[:, :0]}, r"doc_lens .* got torch.int64 of shape \(2, 0\)"),
        ({"doc_lens": lens.bool()}, r"doc_lens .* got torch.bool"),
        ({"position_ids": torch.arange(16)}, r"position_ids must be \[batch, seq\] = \[2, 16\]"),
        ({"position_ids": torch.arange(15).expand(2, 15)}, r"got \(2, 15\)"),
    ):
        with pytest.raises(ValueError, match=needle):
            model(ids, **kwargs)
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\]"):
        model(ids[0])
    for wrong, needle in (
        (ids[:, :0], r"at least one position, got torch.int64 of shape \(2, 0\)"),
        (ids.float(), r"integer token ids .* got torch.float32"),
        (ids.clone().fill_(config.vocab_size), rf"\[0, vocab_size {config.vocab_size}\), got"),
        (ids - config.vocab_size, r"got -"),
    ):
        with pytest.raises(ValueError, match=needle):
            model(wrong)
    assert calls == []
    # a position row and document lengths shared by the batch are accepted
    shared = model(ids, position_ids=torch.arange(16)[None])
    torch.testing.assert_close(shared, model(ids))
    one = model(ids, doc_lens=lens[:1])
    torch.testing.assert_close(one, model(ids, doc_lens=lens[:1].expand(2, -1)))
    # flex attention too (its mask reads the shared row for every batch row)
    models = {name: Llama(dataclasses.replace(config, attention=name)) for name in ("sdpa", "flex")}
    models["flex"].load_state_dict(models["sdpa"].state_dict())
    with torch.no_grad():
        flex, sdpa = (models[name](ids, doc_lens=lens[:1]) for name in ("flex", "sdpa"))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_a_label_outside_the_vocabulary_is_refused(kernels):
    hidden = torch.randn(2, 4, 16, requires_grad=True)
    weight = torch.randn(10, 16, requires_grad=True)
    labels = torch.tensor([[1, 2, 3, 12], [0, 1, -100, 3]])
    error = ValueError if kernels == "native" else (RuntimeError, IndexError)
    with pytest.raises(error, match="12"):
        linear_cross_entropy(hidden, weight, labels)
