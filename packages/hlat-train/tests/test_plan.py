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
    holdings,
    make_plan,
    peak_in_flight,
    rank_stages,
    real_shards,
    roles,
    schedule_actions,
    stage_shapes,
    stage_splits,
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


def state_bytes_of_a_step_on_a_fake_group(config: TrainConfig, layout: Layout) -> int:
    """Optimizer-state bytes dp rank 0 holds after one step of hlat-optim's AdamW built as
    the trainer builds it for ``layout.dp_shard``, on torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hlat_model import Llama
    from hlat_optim import AdamW
    from hlat_parallel import init_parallel, parallelize, zero1_optimizer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    try:
        dims = init_parallel(layout.tp, False, "torch", device="cpu")
        model = Llama(config.llama_config()).to(torch.bfloat16)
        parallelize(model, dims, model.parallel_plan(), dp_shard=layout.dp_shard)
        kwargs = dict(lr=1e-3, stochastic_rounding=True, impl="reference")
        if layout.dp_shard == "zero1":
            optimizer = zero1_optimizer(AdamW, model.parameters(), dims, **kwargs)
        else:
            optimizer = AdamW(model.parameters(), **kwargs)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        return sum(
            (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
            for per_param in optimizer.state.values()
            for t in per_param.values()
            if torch.is_tensor(t)
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dp_shard", ["zero1", "none"])
@pytest.mark.parametrize("tp, world", [(1, 2), (2, 4)])
def test_zero1_and_unsharded_layouts_hold_whole_parameters_and_the_planned_state(
    dp_shard, tp, world
):
    config = small_config("bf16-sr")
    llama = config.llama_config()
    layout = dataclasses.replace(_layout(tp, world), dp_shard=dp_shard)
    shards = real_shards(llama, layout, 0)
    assert shards == analytic_shards(tp_shapes(llama, tp), layout, 0)
    assert all(s.local_numel == s.tp_numel for s in shards)  # whole TP shards
    assert roles(tp_shapes(llama, tp), layout) == [list(range(layout.dp))]
    held = holdings(shards, layout)["optimizer"]
    measured = state_bytes_of_a_step_on_a_fake_group(config, layout)
    # ZeRO-1: rank 0's slice of each tensor, which the plan rounds up per tensor
    assert held == pytest.approx(measured, rel=0.01)
    whole = sum(s.tp_numel for s in shards) * 4
    assert held > whole if dp_shard == "none" else held < whole / 1.9


def test_zero1_plan_names_its_collectives_and_writes_an_even_share(capsys):
    config = small_config("bf16-sr", "--parallel.dp_shard=zero1")
    plan = make_plan(config, device_memory_gib=1.0, procs_per_node=4)
    (role,) = plan.roles
    names = [c.what for c in role.comm]
    assert "ZeRO-1 all-gather, updated parameters" in names
    assert "all-reduce, gradients" in names
    assert not any("FSDP2" in n for n in names)
    fsdp = make_plan(small_config("bf16-sr"), device_memory_gib=1.0, procs_per_node=4)
    # DCP writes each replicated parameter once: per rank, about what FSDP's shards write
    total = sum(r.checkpoint_bytes * len(r.dp_ranks) for r in fsdp.roles)
    assert role.checkpoint_bytes * 4 == pytest.approx(total, rel=0.02)
    assert "DTensor + ZeRO-1" in plan.render()


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
    assert main([*argv, "--device", "trn1"]) == 1
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out
    assert "the biggest item is activations" in captured.err
    assert "rerun with --parallel.tp=" in captured.err
    fix = captured.err.split("rerun with ")[1].split()
    assert main([*argv, "--device", "trn1", *fix]) == 0


@pytest.mark.parametrize(
    "backend, planned",
    [("auto", "backend torch (DTensor + FSDP2)"), ("neuron", "backend neuron (NxD + ZeRO-1)")],
)
def test_device_memory_without_a_device_plans_a_custom_device(backend, planned, capsys):
    argv = ["plan", "--config", "hlat-7b", f"--parallel.backend={backend}"]
    assert main([*argv, "--device-memory-gib", "40", "--procs-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "on custom device: 1 node(s) x 8 = 8 processes, 40 GiB each" in out
    assert planned in out


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


# --- pipeline and context parallelism -----------------------------------------------------

PIPELINED = [*SMALL, "--model.n_layers=6", "--train.global_batch_size=16", "--optim.precision=fp32"]


def test_pipeline_stage_holdings_sum_over_stages_to_the_whole_model():
    config = small_config("fp32", "--model.n_layers=6")
    llama = config.llama_config()
    whole = {s.name: s.local_numel for s in real_shards(llama, _layout(1, 1, "fp32"), 0)}
    layout = dataclasses.replace(_layout(1, 4, "fp32"), pp=4, global_batch=8)
    held: dict[str, int] = {}
    for pp_rank in range(4):
        for shard in real_shards(llama, layout, 0, pp_rank):
            assert shard.name not in held  # no parameter sits on two pipeline ranks
            held[shard.name] = shard.local_numel
    assert held == whole
    first, last = real_shards(llama, layout, 0, 0), real_shards(llama, layout, 0, 3)
    assert "embed_tokens.weight" in {s.name for s in first}
    assert {"norm.weight", "lm_head.weight"} <= {s.name for s in last}


def test_pipeline_ranks_report_what_their_stages_hold_under_fsdp_and_tp():
    config = small_config("fp32", "--model.n_layers=6")
    llama = config.llama_config()
    layout = dataclasses.replace(_layout(2, 16, "fp32"), pp=2, global_batch=16)  # dp 4
    shapes = tp_shapes(llama, 2)
    splits = stage_splits(llama, layout)
    for pp_rank in range(2):
        mine = stage_shapes(shapes, rank_stages(splits, layout, pp_rank))
        for dp_rank in range(layout.dp):
            real = real_shards(llama, layout, dp_rank, pp_rank)
            assert real == analytic_shards(mine, layout, dp_rank)


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_single_stage_schedules_keep_the_papers_micro_batches_in_flight(schedule):
    # 1F1B: stage s of p keeps min(p - s, m) micro-batches (Narayanan et al. 2021); GPipe: m
    config = TrainConfig.preset(
        "tiny-demo",
        [
            *PIPELINED,
            "--parallel.pp=4",
            f"--parallel.pp_schedule={schedule}",
            "--train.global_batch_size=32",
        ],
    )
    plan = make_plan(config, device_memory_gib=1.0, procs_per_node=8)  # dp 2: m = 8
    in_flight = {rank: role.in_flight for role in plan.roles for rank in role.pp_ranks}
    expected = {s: (min(4 - s, 8) if schedule == "1F1B" else 8) for s in range(4)}
    assert in_flight == expected


def test_gpipe_keeps_m_over_1f1b_times_the_activations_of_the_first_stage():
    def activations(schedule: str) -> float:
        config = TrainConfig.preset(
            "tiny-demo",
            [
                *PIPELINED,
                "--parallel.pp=4",
                f"--parallel.pp_schedule={schedule}",
                "--train.global_batch_size=32",
            ],
        )
        (role,) = [
            r
            for r in make_plan(config, device_memory_gib=1.0, procs_per_node=8).roles
            if r.pp_ranks == [0]
        ]
        return dict(role.memory)[next(n for n, _ in role.memory if n.startswith("activations"))]

    assert activations("GPipe") == pytest.approx(activations("1F1B") * 8 / 4)


def _torch_rank_ops(schedule: str, pp: int, m: int, virtual: int, rank: int) -> list:
    """torch's own action list for one rank, from the schedule's (private) generator."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, f"Schedule{schedule}")
    obj = cls.__new__(cls)
    obj.pp_group_size, obj.n_local_stages, obj._n_microbatches = pp, virtual, m
    obj.number_of_rounds = max(1, m // pp)
    obj.microbatches_per_round = m // obj.number_of_rounds
    obj.num_stages = pp * virtual
    out = []
    for action in obj._calculate_single_rank_operations(rank):
        if action is None:
            continue
        kind = str(action.computation_type.value)
        release = "B" if schedule == "Interleaved1F1B" else "W"
        if kind == "F":
            out.append((1, action.stage_index))
        elif kind == release:
            out.append((-1, action.stage_index))
    return out


@pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13),
    reason="torch's private schedule generator takes another form before 2.13",
)
@pytest.mark.parametrize(
    "schedule, pp, m, virtual",
    [
        ("Interleaved1F1B", 4, 8, 2),
        ("Interleaved1F1B", 4, 12, 3),
        ("Interleaved1F1B", 4, 3, 2),
        ("InterleavedZeroBubble", 4, 8, 2),
        ("InterleavedZeroBubble", 3, 9, 2),
        ("ZBVZeroBubble", 4, 8, 2),
        ("ZBVZeroBubble", 4, 5, 2),
    ],
)
def test_multi_stage_schedule_orders_are_torchs(schedule, pp, m, virtual):
    for rank in range(pp):
        ours = schedule_actions(schedule, pp, m, virtual, rank)
        assert ours == _torch_rank_ops(schedule, pp, m, virtual, rank)


def test_interleaved_first_rank_keeps_korthikantis_share_of_the_layers():
    # Korthikanti et al. 2022, 4.2.3: the first rank stores L (1 + (p - 1) / (p v)) layers
    pp, virtual, m, layers = 4, 2, 16, 64
    layout = dataclasses.replace(
        _layout(1, pp),
        pp=pp,
        pp_schedule="Interleaved1F1B",
        pp_virtual=virtual,
        global_batch=m * 2 * 1,
    )
    per_stage = layers // (pp * virtual)
    live = peak_in_flight(layout, 0, {0: 1.0, 4: 1.0})
    assert sum(live.values()) * per_stage == layers * (1 + (pp - 1) / (pp * virtual))


def test_pipeline_plan_prints_the_schedules_bubble_fraction(capsys):
    from hlat_parallel import bubble_fraction

    argv = ["plan", "--config", "tiny-demo", *PIPELINED, "--parallel.pp=4"]
    argv += ["--train.global_batch_size=64", "--device-memory-gib", "1", "--procs-per-node", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    m = 64 // (2 * 2)  # global batch / (micro-batch 2 x dp 2): 8 processes = pp 4 x dp 2
    assert bubble_fraction("1F1B", 4, m) == pytest.approx(3 / 16)
    assert f"pipeline bubble: {3 / 16:.2%} of compute" in out
    assert "pp 4 (1F1B, 1 stage per rank)" in out
    assert "pipeline micro-batches 16" in out


def test_pipeline_sends_one_micro_batchs_activations_per_boundary_each_way():
    config = TrainConfig.preset(
        "tiny-demo", [*PIPELINED, "--parallel.pp=4", "--parallel.tp=2", "--parallel.sp=true"]
    )
    plan = make_plan(config, device_memory_gib=1.0, procs_per_node=16)  # dp 2, m 4
    hidden = 2 * 32 * 64 * 4 / 2  # micro-batch x seq_len x dim x fp32 / tp (SP)
    for role in plan.roles:
        sent = {c.what: c for c in role.comm if c.dim == "pp" and "pipeline" in c.what}
        forward = sent.get("pipeline send, activations to the next stage")
        backward = sent.get("pipeline send, gradients to the previous stage")
        position = role.pp_ranks[0]
        assert (forward is None) == (position == 3)
        assert (backward is None) == (position == 0)
        for c in (forward, backward):
            if c is not None:
                assert (c.calls, c.bytes_sent) == (4, 4 * hidden)


def _cp_memory(cp: int, checkpointing: str) -> dict[str, float]:
    config = TrainConfig.preset(
        "tiny-demo",
        [
            *SMALL,
            "--model.n_kv_heads=2",
            "--optim.precision=fp32",
            f"--model.checkpointing={checkpointing}",
            f"--parallel.cp={cp}",
            "--train.global_batch_size=4",
        ],
    )
    (role,) = make_plan(config, device_memory_gib=1.0, procs_per_node=2).roles
    return dict(role.memory)


def _pick(items: dict[str, float], start: str) -> float:
    return sum(v for k, v in items.items() if k.startswith(start))


def test_context_parallelism_divides_activations_except_the_gathered_keys_and_values():
    whole, split = _cp_memory(1, "none"), _cp_memory(2, "none")
    own_kv = 2 * 32 * 2 * 2 * 16 * 4  # micro-batch x seq x (k, v) x kv heads x head_dim x fp32
    mask = 16 * 32 * 4  # [seq / cp, seq] in fp32
    # cp 1 keeps each layer's own keys and values; cp 2 the gathered ones and the mask
    assert _pick(split, "CP all-gathered keys and values") == 2 * (own_kv + mask)  # 2 layers
    assert _pick(split, "activations") == pytest.approx(
        (_pick(whole, "activations") - 2 * own_kv) / 2
    )


def test_selective_context_parallelism_keeps_no_gathered_keys_and_values():
    # the attention core, the all-gather with it, is recomputed in backward
    whole, split = _cp_memory(1, "selective"), _cp_memory(2, "selective")
    assert _pick(split, "CP all-gathered") == 0
    assert _pick(split, "activations") == pytest.approx(_pick(whole, "activations") / 2)


def test_context_parallel_traffic_gathers_keys_and_values_and_shards_fsdp_over_dp_x_cp():
    config = TrainConfig.preset(
        "tiny-demo",
        [
            *SMALL,
            "--model.n_kv_heads=2",
            "--optim.precision=fp32",
            "--model.checkpointing=selective",
            "--parallel.cp=2",
            "--train.global_batch_size=8",
        ],
    )
    plan = make_plan(config, device_memory_gib=1.0, procs_per_node=4)  # dp 2 x cp 2
    (role,) = plan.roles
    comm = {(c.dim, c.what): c for c in role.comm}
    kv = 2 * 32 * 2 * 2 * 16 * 4  # the gathered keys and values of one layer
    # per layer and micro-step (2 x 2): forward, and again in the selective recomputation
    gather = comm[("cp", "CP all-gather, keys and values")]
    assert (gather.calls, gather.bytes_sent) == (2 * 2 * 2, 2 * 2 * 2 * kv / 2)
    scatter = comm[("cp", "CP reduce-scatter, key and value gradients")]
    assert (scatter.calls, scatter.bytes_sent) == (2 * 2, 2 * 2 * kv / 2)
    assert ("dp x cp", "FSDP2 all-gather, parameters") in comm
    assert role.ranks_text() == "dp x cp ranks 0-3: 4 ranks"


@pytest.mark.parametrize(
    "argv, fits_on",
    [
        (["--config", "llama2-70b-trn1"], "16 GiB"),
        (["--config", "llama3-70b", "--device", "h100"], "80 GiB"),
        (["--config", "llama3-8b-32k", "--device", "h100"], "80 GiB"),
    ],
)
def test_pipeline_and_long_context_presets_fit_at_their_intended_sizes(argv, fits_on, capsys):
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out
    assert f"fits (usable {float(fits_on.split()[0]) * 0.9:.2f} of {fits_on}" in out
    # trn1 (NxD): the plan computes pipeline stages that hlat's trn1 path cannot run yet
    neuron = argv[1] == "llama2-70b-trn1"
    assert ("does not run pipeline parallelism yet" in out) == neuron
    if neuron:
        assert "tp 32 (sp), dp 4, pp 8 (1F1B, 1 stage per rank)" in out
        assert "use parallel.backend = 'torch'" in out


def test_a_pipeline_that_cannot_fit_names_the_biggest_item_and_suggests_more_stages(capsys):
    argv = [
        "plan", "--config", "tiny-demo", *SMALL, "--model.n_layers=4", "--parallel.tp=4",
        "--model.checkpointing=full", "--data.micro_batch_size=1",
        "--model.vocab_size=16384", "--train.global_batch_size=8", "--optim.precision=fp32",
        "--device-memory-gib", "0.0075", "--procs-per-node", "16",
    ]  # fmt: skip
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "the biggest item is FSDP2 gathered parameters" in captured.err
    assert "rerun with --parallel.pp=2" in captured.err
    fix = captured.err.split("rerun with ")[1].split()
    assert main([*argv, *fix]) == 0


def test_a_suggestion_that_changes_dp_keeps_the_global_batch_of_micro_batch_x_dp(tmp_path, capsys):
    # train.global_batch_size = 0: 1 x dp 2 here; pp 2 halves dp, and a rerun that
    # recomputed the batch (1 x dp 1) would give 1F1B one micro-batch for two stages
    config = tmp_path / "run.toml"
    config.write_text(
        '[train]\nsteps = 10000\n[model]\npreset = "llama3-8b"\ncheckpointing = "selective"\n'
        "[data]\nseq_len = 8192\n"
    )
    argv = [
        "plan", "--config", str(config), "--parallel.backend=torch", "--parallel.tp=4",
        "--device-memory-gib", "40", "--procs-per-node", "8",
    ]  # fmt: skip
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "tp 4, dp 1, pp 2 (1F1B" in captured.err
    fix = captured.err.split("rerun with ")[1].split()
    assert fix == ["--parallel.pp=2", "--train.global_batch_size=2"]
    assert main([*argv, *fix]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parallel.pp=3"], "not divisible by parallel.pp x parallel.cp x parallel.tp"),
        (["--parallel.pp=2", "--parallel.pp_schedule=Zigzag"], "is not one of 1F1B"),
        (["--parallel.cp=2"], "has no context parallelism"),
        (
            ["--parallel.cp=2", "--device", "h100", "--data.document_mask=true"],
            "does not support document masking",
        ),
    ],
)
def test_bad_pipeline_and_context_options_fail_before_any_work(argv, message, capsys):
    assert main(["plan", "--config", "hlat-7b", "--nodes", "4", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "building rank" not in captured.err


def test_nodes_option_replaces_the_node_count_a_config_expects(capsys):
    argv = ["plan", "--config", "tiny-demo", *SMALL, "--parallel.nodes=4"]
    argv += ["--device-memory-gib", "1", "--procs-per-node", "2", "--nodes", "2"]
    assert main(argv) == 0
    assert "2 node(s) x 2 = 4 processes" in capsys.readouterr().out


def test_the_plans_loss_term_is_what_the_loss_keeps_for_backward():
    """Without TP on the torch backend the plan counts the logits only (``T V A``), the
    neuron backend also their fp32 copy and log-softmax; and that is what
    ``hlat_model.cross_entropy_loss`` keeps: the logits and a few numbers per token."""
    from hlat_model import cross_entropy_loss
    from hlat_train.plan import activation_parts

    llama = small_config("bf16-sr").llama_config()
    layout = _layout(1, 1)
    tokens, vocab = layout.local_tokens, llama.vocab_size
    torch_head = activation_parts(llama, layout).head
    neuron_head = activation_parts(llama, _layout(1, 1, backend="neuron")).head
    assert neuron_head - torch_head == tokens * vocab * 8

    logits = torch.randn(layout.micro_batch, layout.seq_len, vocab, dtype=torch.bfloat16)
    logits.requires_grad_()
    saved: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        cross_entropy_loss(logits, torch.randint(0, vocab, logits.shape[:-1]))
    kept = sum(t.numel() * t.element_size() for t in saved)
    assert tokens * vocab * 2 <= kept <= tokens * vocab * 2 + tokens * 16 + 8


def test_a_vocabulary_that_follows_the_tokenizer_is_the_tokenizers_where_its_file_is(
    corpus, tmp_path
):
    def plan(*extra: str):
        return make_plan(small_config("fp32", *extra), device_memory_gib=1.0, procs_per_node=1)

    pieces = f'--data.tokenizer="{corpus["tokenizer"]}"'
    followed = plan("--model.vocab_size=0", pieces)  # 384 pieces
    assert followed.params_total == plan("--model.vocab_size=384").params_total
    assert followed.roles[0].total == plan("--model.vocab_size=384").roles[0].total
    assert f"model.vocab_size 0: 384, the 384 pieces of data.tokenizer {corpus['tokenizer']}" in (
        followed.render()
    )
    missing = plan("--model.vocab_size=0", f'--data.tokenizer="{tmp_path}/none.model"')
    assert missing.params_total == plan("--model.vocab_size=64").params_total
    assert "is not a file here: the plan assumes a vocabulary of 64" in missing.render()
