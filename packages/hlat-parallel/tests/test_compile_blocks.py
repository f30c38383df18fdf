"""compile_blocks: each transformer block through torch.compile, in place, names kept."""

from pathlib import Path

import pytest
import torch
from spawn import run_ranks
from torch import nn

from hlat_parallel import compile_blocks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(self.proj(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def test_blocks_compile_in_place_keep_their_names_and_compute_the_same():
    torch.manual_seed(0)
    eager, compiled = Net(), Net()
    compiled.load_state_dict(eager.state_dict())
    names = list(compiled.state_dict())
    assert compile_blocks(compiled, backend="inductor") == 3
    assert list(compiled.state_dict()) == names  # checkpoints and plans see the same names
    assert all(b._compiled_call_impl is not None for b in compiled.layers)
    assert getattr(compiled.embed, "_compiled_call_impl", None) is None
    x = torch.randn(5, 8)
    eager(x).square().sum().backward()
    compiled(x).square().sum().backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_loss_held_as_a_submodule_is_left_eager_and_the_blocks_compile():
    """``parallelize(..., compile=True)`` on a model whose ``loss_fn`` is an ``nn.Module``:
    the blocks compile, the loss module stays where it is, and the model computes as the
    eager one."""
    from hlat_parallel import ParallelDims, parallelize

    class WithLossModule(Net):
        def __init__(self) -> None:
            super().__init__()
            self.loss_fn = nn.CrossEntropyLoss()

    torch.manual_seed(0)
    eager, compiled = WithLossModule(), WithLossModule()
    compiled.load_state_dict(eager.state_dict())
    loss_module = compiled.loss_fn
    dims = ParallelDims(
        world_size=1, rank=0, tp=1, dp=1, sp=False, backend="torch",
        device=torch.device("cpu"), tp_rank=0, dp_rank=0,
    )  # fmt: skip
    parallelize(compiled, dims, {}, compile=True)
    assert compiled.loss_fn is loss_module
    assert all(b._compiled_call_impl is not None for b in compiled.layers)
    x, labels = torch.randn(5, 8), torch.randint(0, 4, (5,))
    eager.loss_fn(eager(x), labels).backward()
    compiled.loss_fn(compiled(x), labels).backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_models_loss_is_compiled_too_and_gives_the_eager_loss_and_gradients():
    """A model with a ``loss_fn`` (hlat-model's Llama) gets it compiled beside its blocks,
    once however often ``compile_blocks`` runs, and trains as the eager model does. The
    hook on the compiled model's head sends its loss through ``loss_fn`` on the logits
    (without it, fp32, and bf16 where the CPU multiplies bf16 natively, fuse the head and
    the loss eagerly)."""
    from hlat_model import Llama, LlamaConfig, cross_entropy_loss

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, ffn_dim=64)
    eager = Llama(config).to(torch.bfloat16)
    compiled = Llama(config).to(torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    assert compile_blocks(compiled, backend="inductor") == 2
    compile_blocks(compiled, backend="inductor")
    assert compiled.loss_fn.hlat_compiled
    assert compiled.loss_fn.__wrapped__ is cross_entropy_loss  # not wrapped twice
    calls = []
    compiled.lm_head.register_forward_hook(lambda *args: calls.append(1))
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :3] = -100
    eager_loss = eager(inputs, labels=labels)
    from torch._dynamo.utils import counters

    counters.clear()
    compiled_loss = compiled(inputs, labels=labels)
    assert calls == [1]
    # the blocks' graph and the loss's (``cross_entropy_loss`` on bf16 logits)
    assert counters["stats"]["unique_graphs"] == 2
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
    eager_loss.backward()
    compiled_loss.backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad.float(), a.grad.float(), rtol=0.05, atol=2e-3, msg=name)


def test_without_tensor_parallelism_the_compiled_llama_still_fuses_its_head_and_loss(
    monkeypatch,
):
    """No module is hooked where nothing is sharded, so hlat-model's Llama, blocks
    compiled, still computes its loss through the fused head and loss (no [B, S, V]
    logits) and gives the eager model's loss."""
    from hlat_model import Llama, LlamaConfig
    from hlat_model import model as llama_module

    fused = []
    real = llama_module.linear_cross_entropy

    def counted(*args, **kwargs):
        fused.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llama_module, "linear_cross_entropy", counted)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, ffn_dim=64)
    eager, compiled = Llama(config), Llama(config)
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled, backend="eager")
    assert not any(m._forward_hooks for m in compiled.modules())
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    eager_loss = eager(tokens[:, :-1], labels=tokens[:, 1:])
    assert fused == [1]
    compiled_loss = compiled(tokens[:, :-1], labels=tokens[:, 1:])
    assert fused == [1, 1]
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)


WORKER = Path(__file__).with_name("compile_worker.py")


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_compiled_blocks_under_tensor_parallelism_train_like_eager_ones(tmp_path, sp):
    """Two ranks, TP2 (and sequence parallel): compiled blocks give the eager run's losses
    and gradients. Without the hook compile_blocks puts on the embedding, the backward
    fails in the reduction of its output."""
    run_ranks(WORKER, [str(tmp_path), "1" if sp else "0"], 2, timeout=600)
    for rank in range(2):
        eager = torch.load(tmp_path / f"eager-rank{rank}.pt", weights_only=True)
        compiled = torch.load(tmp_path / f"compiled-rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
        assert eager["grads"].keys() == compiled["grads"].keys()
        for name, grad in eager["grads"].items():
            torch.testing.assert_close(
                compiled["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name
            )
