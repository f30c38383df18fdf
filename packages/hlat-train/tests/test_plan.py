"""``hlat-train plan``: per-rank bytes from the real layout on a fake process group, checked
against what a real run stores; the shipped presets fit; a layout that cannot fit is refused
with a suggestion; bad options fail before any work."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from hlat_train import TrainConfig
from hlat_train.cli import main
from hlat_train.plan import (
    Layout,
    analytic_shards,
    make_plan,
    real_shards,
    roles,
    tp_shapes,
)

SMALL = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.ffn_dim=96",
    "--model.vocab_size=256",
    "--model.max_seq_len=64",
    "--data.seq_len=32",
    "--data.micro_batch_size=2",
    "--parallel.backend=torch",
]


def small_config(precision: str, *extra: str) -> TrainConfig:
    return TrainConfig.preset("tiny-demo", [*SMALL, f"--optim.precision={precision}", *extra])


def stored_after_one_step(config: TrainConfig) -> tuple[int, int]:
    """Bytes of parameters and of optimizer state that a single-process run holds after a
    real step of hlat-optim's AdamW, built as the trainer builds it."""
    from hlat_model import Llama, cross_entropy_loss
    from hlat_optim import AdamW

    o = config.optim
    torch.manual_seed(0)
    dtype = torch.float32 if o.precision == "fp32" else torch.bfloat16
    model = Llama(config.llama_config()).to(dtype)
    optimizer = AdamW(
        model.parameters(),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        weight_decay=o.weight_decay,
        stochastic_rounding=o.precision in ("bf16-sr", "bf16-kahan"),
        master_weights=o.precision == "mixed",
        kahan_sum=o.precision == "bf16-kahan",
        impl="reference",
    )
    ids = torch.randint(0, 256, (2, 32))
    cross_entropy_loss(model(ids), ids).backward()
    optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(
        t.numel() * t.element_size()
        for per_param in optimizer.state.values()
        for t in per_param.values()
        if torch.is_tensor(t)
    )
    return params, state


@pytest.mark.parametrize("precision", ["fp32", "bf16-sr", "mixed", "bf16-kahan"])
def test_plan_bytes_equal_what_a_real_single_process_step_stores(precision):
    config = small_config(precision)
    plan = make_plan(config, device_memory_gib=1.0, procs_per_node=1)
    (role,) = plan.roles
    params, state = stored_after_one_step(config)
    assert role.held["parameters"] == params
    assert role.held["optimizer"] == state


def _layout(tp: int, world: int, precision: str = "bf16-sr", backend: str = "torch") -> Layout:
    return Layout(1, world, tp, False, backend, precision, "selective", 2, 32, 2 * world // tp)


@pytest.mark.parametrize("tp, world", [(1, 2), (2, 2)])
def test_two_way_layout_on_a_fake_process_group_holds_half_of_each_weight(tp, world):
    config = small_config("fp32")
    llama = config.llama_config()
    layout = _layout(tp, world, "fp32")
    whole = sum(s.local_numel for s in real_shards(llama, _layout(1, 1, "fp32"), 0))
    for dp_rank in range(layout.dp):
        shards = real_shards(llama, layout, dp_rank)
        assert not dist.is_initialized()  # the plan cleans up its fake process group
        held = sum(s.local_numel * s.element_size for s in shards)
        # norms are replicated under tp without sp; everything else splits in two
        norms = sum(s.local_numel for s in shards if s.name.endswith("norm.weight"))
        expected = whole // 2 + (norms // 2 if tp > 1 else 0)
        assert held == expected * 4
        assert shards == analytic_shards(tp_shapes(llama, tp), layout, dp_rank)


def test_uneven_fsdp_chunks_give_distinct_roles_that_the_real_layout_confirms():
    # hlat-7b at tp 8 over dp 512: 4000 vocabulary rows and 2752 gate_up rows per TP rank do
    # not split evenly over 512, so the last dp ranks hold less (some nothing) of those
    config = TrainConfig.preset("llama2-7b-trn1-128", ["--parallel.backend=torch"])
    llama = config.llama_config()
    layout = dataclasses.replace(
        _layout(8, 4096), nodes=128, procs_per_node=32, sp=True, global_batch=1024
    )
    shapes = tp_shapes(llama, 8)
    groups = roles(shapes, layout)
    assert [g[0] for g in groups] == [0, 458, 459, 500]
    assert sum(len(g) for g in groups) == 512
    for group in groups:
        assert real_shards(llama, layout, group[0]) == analytic_shards(shapes, layout, group[0])


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "hlat-7b", "--nodes", "64"],
        ["--config", "llama2-7b-trn1-128"],
        ["--config", "hlat-7b-trn2", "--device", "trn2"],
    ],
)
def test_shipped_presets_fit_at_their_intended_sizes(argv, capsys):
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "optimizer state" in out and "activations" in out
    assert "pipeline bubble: 0" in out
    assert "DOES NOT FIT" not in out


def test_llama2_128_node_plan_shows_the_world_and_zero1_roles(capsys):
    assert main(["plan", "--config", "llama2-7b-trn1-128"]) == 0
    out = capsys.readouterr().out
    assert "128 node(s) x 32 = 4096 processes" in out
    assert "tp 8 (sp), dp 512" in out
    assert "role 1 of 2: dp rank 0 x tp ranks 0-7: 8 ranks" in out
    assert "dp ranks 1-511 x tp ranks 0-7: 4088 ranks" in out


def test_a_layout_that_cannot_fit_exits_nonzero_naming_the_biggest_item_and_a_fix(capsys):
    argv = ["plan", "--config", "hlat-7b", "--parallel.tp=1", "--model.checkpointing=none"]
    assert main([*argv, "--device-memory-gib", "16"]) == 1
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out
    assert "the biggest item is activations" in captured.err
    assert "rerun with --parallel.tp=" in captured.err
    fix = captured.err.split("rerun with ")[1].split()
    assert main([*argv, "--device-memory-gib", "16", *fix]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "h10"], "did you mean 'h100'"),
        (["--device", "trn1", "--procs-per-node", "12"], "not divisible by parallel.tp 8"),
        (["--device", "h100", "--parallel.backend=neuron"], "trn1 only"),
    ],
)
def test_bad_options_fail_before_any_work(argv, message, capsys):
    assert main(["plan", "--config", "hlat-7b", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""
    assert "building rank" not in captured.err
