"""The MLP's CPU path: the gate/up product computed with the weight's gate rows first and
its up rows second, and ``_SwiGLUFunction`` on the two dense halves, against the
composition on the interleaved product that DTensors and other devices still take; and
the two products with every other row of the weight that code being compiled on CPUs
takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hlat_model import LlamaConfig
from hlat_model.model import MLP, _swiglu, _SwiGLUFunction


def _graph_names(tensor: torch.Tensor) -> set[str]:
    names, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and type(node).__name__ not in names:
            names.add(type(node).__name__)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def _error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return ((ours.double() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("width", [48, 50])  # whole vectors of 16, and a tail
@pytest.mark.parametrize("keep_silu", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_function_against_autograd_and_float64(kernels, dtype, keep_silu, width):
    """Torch's operators: autograd's numbers bit for bit. The fused kernel (fp32 inside,
    rounded once): output and gradient as close to float64 as autograd's, within one
    rounding of the dtype."""
    gate_up = (torch.randn(3, 20, 2 * width) * 3).to(dtype)
    gate_up[0, 0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # the sigmoid's ends
    grad = torch.randn(3, 20, width).to(dtype)
    ours_in, theirs_in = gate_up.clone().requires_grad_(), gate_up.clone().requires_grad_()
    exact_in = gate_up.double().requires_grad_()

    ours = _SwiGLUFunction.apply(ours_in, keep_silu)
    assert (ours.grad_fn.native is not None) == (kernels == "native")
    gate, up = theirs_in.chunk(2, dim=-1)
    theirs = F.silu(gate) * up
    exact_gate, exact_up = exact_in.chunk(2, dim=-1)
    exact = F.silu(exact_gate) * exact_up
    for t, g in ((ours, grad), (theirs, grad), (exact, grad.double())):
        t.backward(g)
    assert ours.dtype == ours_in.grad.dtype == dtype
    if kernels == "composed":
        assert torch.equal(ours, theirs)
        assert torch.equal(ours_in.grad, theirs_in.grad)
        return
    unit = 2**-8 if dtype == torch.bfloat16 else 2**-22
    for a, b, e in ((ours, theirs, exact), (ours_in.grad, theirs_in.grad, exact_in.grad)):
        e = e.detach()
        assert _error(a, e) <= _error(b, e) + unit
        torch.testing.assert_close(a.double(), e, rtol=2 * unit, atol=2 * unit * e.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interleaved_gate_and_up_give_the_numbers_of_the_halves(kernels, dtype):
    """``interleaved``: gate and up alternate in ``gate_up`` (the fused product's own row
    order, which the MLP feeds the fused kernel): the same output as on the halves, and the
    same gradient in the input's layout, bit for bit."""
    width = 50
    halves = (torch.randn(3, 20, 2 * width) * 3).to(dtype).requires_grad_()
    mixed = halves.detach().unflatten(-1, (2, width)).transpose(-1, -2).flatten(-2)
    mixed.requires_grad_()
    grad = torch.randn(3, 20, width).to(dtype)
    ours = _SwiGLUFunction.apply(mixed, True, True)
    theirs = _SwiGLUFunction.apply(halves, True)
    assert torch.equal(ours, theirs)
    ours.backward(grad)
    theirs.backward(grad)
    assert torch.equal(
        mixed.grad.unflatten(-1, (width, 2)).transpose(-1, -2).flatten(-2), halves.grad
    )


def test_non_finite_inputs_propagate(kernels):
    gate_up = torch.zeros(2, 8)
    gate_up[0, 1], gate_up[1, 2], gate_up[1, 6] = float("nan"), 1.0, float("inf")
    out = _SwiGLUFunction.apply(gate_up, True)
    assert out[0, 1].isnan() and out[1, 2].isinf()
    assert out[0, [0, 2, 3]].eq(0).all()


def test_selective_keeps_only_the_product(kernels):
    """``keep_silu=False`` (selective checkpointing) keeps ``gate_up`` alone for backward;
    so does the fused kernel always (its backward recomputes the activation)."""
    gate_up = torch.randn(4, 2 * 32, requires_grad=True)

    def saved_elements(keep_silu: bool) -> int:
        seen: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _SwiGLUFunction.apply(gate_up, keep_silu)
        return sum(seen)

    assert saved_elements(False) == gate_up.numel()
    keeps = 1 if kernels == "native" else 3 / 2
    assert saved_elements(True) == gate_up.numel() * keeps


def _pair(dtype: torch.dtype, checkpointing: str = "none") -> tuple[MLP, MLP]:
    config = LlamaConfig(
        vocab_size=64, dim=64, n_layers=1, n_heads=4, ffn_dim=96, checkpointing=checkpointing
    )
    ours = MLP(config).to(dtype)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.1)
    theirs = MLP(config).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _interleaved(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(_swiglu(mlp.gate_up_proj(x)))


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mlp_matches_the_interleaved_composition(kernels, dtype, checkpointing):
    """The same products, their output columns in another order, and the same SwiGLU (the
    fused kernel rounds once where the composition rounds the activation first): output
    and gradients as close to a float64 copy of the layer as the composition's are."""
    ours, theirs = _pair(dtype, checkpointing)
    exact = _pair(torch.float64)[1]
    exact.load_state_dict(ours.state_dict())
    x = torch.randn(2, 24, 64).to(dtype)
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    exact_x = x.double().requires_grad_()
    out, ref, ref64 = ours(ours_x), _interleaved(theirs, theirs_x), _interleaved(exact, exact_x)
    assert "_SwiGLUFunctionBackward" in _graph_names(out)
    grad = torch.randn_like(out)
    for t in (out, ref, ref64):
        t.backward(grad.to(t.dtype))
    pairs = [("output", out, ref, ref64), ("input", ours_x.grad, theirs_x.grad, exact_x.grad)]
    for name, p in ours.named_parameters():
        q, e = dict(theirs.named_parameters())[name], dict(exact.named_parameters())[name]
        assert p.grad.dtype == dtype and p.grad.shape == p.shape
        pairs.append((name, p.grad, q.grad, e.grad))
    unit = 2**-9 if dtype == torch.bfloat16 else 2**-22
    for what, a, b, e in pairs:
        e = e.detach()
        assert _error(a, e) <= _error(b, e) * 1.25 + unit, what


def test_a_hooked_projection_is_still_called():
    """Another trainer's forward hook on ``gate_up_proj`` (an adapter, a quantiser) sees
    the call: the direct product is taken for unhooked hlat ``Linear`` layers only."""
    mlp, _ = _pair(torch.float32)
    calls: list[torch.Size] = []
    mlp.gate_up_proj.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    out = mlp(torch.randn(2, 5, 64))
    assert calls == [torch.Size([2, 5, 2 * 96])]
    assert "_SwiGLUFunctionBackward" not in _graph_names(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_keeps_the_weight_not_a_permuted_copy(dtype, kernels):
    """What the gate/up product keeps for backward is the parameter itself: a permuted
    copy kept until backward would be a second weight per layer (of the unsharded weight
    under FSDP). With the fused kernels the product is the plain one (the kernel reads
    gate and up interleaved), without them a product with permuted rows."""
    mlp, _ = _pair(dtype)
    weight = mlp.gate_up_proj.weight
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mlp(torch.randn(2, 5, 64).to(dtype).requires_grad_())
    weight_sized = [t for t in saved if t.numel() == weight.numel()]
    assert weight_sized, "the product keeps its weight for backward"
    assert all(t.data_ptr() == weight.data_ptr() for t in weight_sized)
    out.sum().backward()
    assert weight.grad is not None and weight.grad.shape == weight.shape


@pytest.mark.compile
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_compiled_on_cpus_gate_and_up_are_strided_products_that_keep_the_weight_itself(
    checkpointing, monkeypatch
):
    """In code being compiled on CPUs without the fused kernels (with them, compiled code
    calls their SwiGLU operator: ``test_compiled_ops.py``), gate and up are two products with every other row
    of the weight (two products in the traced forward, none of the composition's
    interleaving), what backward keeps holds no copy of the weight or of its halves (only
    views of it: a copy would be a second weight per layer until backward, of the
    unsharded weight under FSDP), and inductor's output and gradients match the
    interleaved composition's."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from hlat_model import _native

    monkeypatch.setenv("HLAT_MODEL_NATIVE", "0")
    _native.reset()
    ours, theirs = _pair(torch.float32, checkpointing)
    weight = ours.gate_up_proj.weight
    forward_products: list[int] = []
    kept_copies: list[str] = []

    def forward_compiler(graph_module, example_inputs):
        nodes = list(graph_module.graph.nodes)
        forward_products.append(sum(n.target == torch.ops.aten.mm.default for n in nodes))
        kept = next(n for n in nodes if n.op == "output").args[0][1:]
        for node in kept:
            value = node.meta.get("val")
            weight_sized = isinstance(value, torch.Tensor) and value.numel() in (
                weight.numel(),
                weight.numel() // 2,
            )
            base = node
            while base.op == "call_function" and base.target.is_view:
                base = base.args[0]
            if weight_sized and base.op != "placeholder":
                kept_copies.append(f"{node.target} of {base.target}")
        return make_boxed_func(graph_module.forward)

    backend = aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        partition_fn=min_cut_rematerialization_partition,
    )
    x = torch.randn(2, 24, 64)
    torch._dynamo.reset()
    try:
        torch.compile(ours, backend=backend, fullgraph=True)(x.clone().requires_grad_())
        assert forward_products == [3]  # gate, up, down
        assert not kept_copies, kept_copies
        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True)
        ours.zero_grad(set_to_none=True)
        ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = compiled(ours_x), _interleaved(theirs, theirs_x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad)
        torch.testing.assert_close(ours_x.grad, theirs_x.grad, rtol=1e-5, atol=1e-5)
        for name, p in ours.named_parameters():
            q = dict(theirs.named_parameters())[name]
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    finally:
        torch._dynamo.reset()
        _native.reset()


def test_an_odd_width_takes_torchs_operators():
    """``gate_up`` of odd width has no two equal halves: the kernel stands aside."""
    gate_up = torch.randn(3, 9, requires_grad=True)
    with pytest.raises(RuntimeError):  # silu(gate) * up of halves 5 and 4 wide
        _SwiGLUFunction.apply(gate_up, True)
