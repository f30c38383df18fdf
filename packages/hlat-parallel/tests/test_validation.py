"""Every layout rule fails early, before any process group or module change, with a message
that says what is wrong and what to do."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hlat_model import Llama, LlamaConfig
from hlat_parallel import (
    ParallelConfigError,
    ParallelDims,
    check_parallel_config,
    init_parallel,
    match_plan,
    parallelize,
    parse_plan,
)


@pytest.fixture
def world(monkeypatch):
    """Pretend to be rank 0 of a torchrun job of the given size (no group is created)."""

    def set_world(size: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("RANK", "0")

    return set_world


def dims_for(tp: int, sp: bool = False) -> ParallelDims:
    return ParallelDims(
        world_size=tp, rank=0, tp=tp, dp=1, sp=sp, backend="torch",
        device=torch.device("cpu"), tp_rank=0, dp_rank=0,
    )  # fmt: skip


def small_llama(**overrides) -> Llama:
    with torch.device("meta"):
        return Llama(LlamaConfig.preset("tiny", n_layers=2, **overrides))


def test_world_size_not_divisible_by_tp_is_refused_before_any_process_group(world):
    world(6)
    with pytest.raises(ParallelConfigError, match=r"world size 6 is not divisible by tp 4"):
        init_parallel(tp=4)
    assert not dist.is_initialized()


def test_world_size_error_lists_the_tp_degrees_that_fit(world):
    world(6)
    with pytest.raises(ParallelConfigError, match=r"pick tp among 1, 2, 3, 6"):
        init_parallel(tp=4)


def test_tp_not_dividing_attention_heads_is_refused(world):
    world(4)
    with pytest.raises(ParallelConfigError, match=r"tp 4 does not divide the 6 attention heads"):
        init_parallel(tp=4, n_heads=6)


def test_tp_not_dividing_kv_heads_says_how_to_replicate_them(world):
    world(8)
    with pytest.raises(ParallelConfigError) as error:
        init_parallel(tp=8, n_heads=32, n_kv_heads=4)
    message = str(error.value)
    assert "tp 8 does not divide the 4 key/value heads" in message
    assert "pick tp among 1, 2, 4" in message
    assert "replicate the KV heads 2 times so there are 8 of them" in message


def test_kv_replication_is_not_offered_when_tp_is_not_a_multiple_of_kv_heads(world):
    world(3)
    with pytest.raises(ParallelConfigError) as error:
        init_parallel(tp=3, n_kv_heads=2)
    assert "pick tp among 1, 2; replicating KV heads needs tp to be a multiple" in str(error.value)


def test_sequence_not_divisible_by_tp_is_refused_under_sequence_parallelism(world):
    world(2)
    with pytest.raises(ParallelConfigError, match=r"seq_len 33 is not divisible by 2"):
        init_parallel(tp=2, sp=True, seq_len=33)


def test_world_not_divisible_by_the_model_parallel_replica_is_refused(world):
    world(8)
    with pytest.raises(ParallelConfigError, match=r"pp x cp x tp = 3 x 1 x 2 = 6"):
        init_parallel(tp=2, pp=3)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"pp": 0}, r"pp must be a positive integer, got 0"),
        ({"cp": True}, r"cp must be a positive integer, got True"),
        ({"cp": 2, "seq_len": 18}, r"2 x cp = 4 equal chunks .* seq_len 18"),
        ({"cp": 2, "tp": 4, "sp": True, "seq_len": 12}, r"of each of the 2 context-parallel"),
    ],
)
def test_pipeline_and_context_degrees_are_checked(kwargs, needle):
    tp = kwargs.pop("tp", 1)
    with pytest.raises(ParallelConfigError, match=needle):
        check_parallel_config(8, tp, **kwargs)


def test_pipeline_and_context_parallelism_are_refused_on_the_nxd_path(world):
    world(4)
    with pytest.raises(ParallelConfigError, match=r"native torch backend only"):
        init_parallel(tp=2, pp=2, backend="neuron")


def test_sequence_length_is_free_without_sequence_parallelism():
    check_parallel_config(2, 2, sp=False, seq_len=33)


def test_non_positive_tp_is_refused(world):
    world(2)
    with pytest.raises(ParallelConfigError, match=r"tp must be a positive integer, got 0"):
        init_parallel(tp=0)


def test_unknown_backend_is_refused(world):
    world(1)
    with pytest.raises(ParallelConfigError, match=r"backend must be 'auto', 'torch' or 'neuron'"):
        init_parallel(backend="xla")  # type: ignore[arg-type]


def test_world_size_without_master_address_asks_for_torchrun(world, monkeypatch):
    world(2)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ParallelConfigError, match=r"MASTER_ADDR is not set; launch with torchrun"):
        init_parallel(tp=2)
    assert not dist.is_initialized()


def test_neuron_backend_without_neuronx_distributed_says_where_to_get_it(world):
    world(1)
    with pytest.raises(RuntimeError, match=r"needs NeuronX Distributed from the Neuron repository"):
        init_parallel(backend="neuron")
    assert not dist.is_initialized()


def test_neuron_backend_without_neuronx_distributed_is_a_configuration_error(world):
    world(1)
    with pytest.raises(ParallelConfigError, match=r"needs NeuronX Distributed"):
        init_parallel(backend="neuron")
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(sp=1), "sp"),
        (dict(sp="yes"), "sp"),
        (dict(n_heads=0), "n_heads"),
        (dict(n_heads=4.0), "n_heads"),
        (dict(n_kv_heads=-2), "n_kv_heads"),
        (dict(n_kv_heads=True), "n_kv_heads"),
        (dict(seq_len=0), "seq_len"),
        (dict(seq_len="64"), "seq_len"),
        (dict(world_size=0), "world_size"),
        (dict(world_size=2.0), "world_size"),
    ],
)
def test_fields_of_the_wrong_type_or_not_positive_are_refused_by_name(kwargs, field):
    args = {"world_size": 2, "tp": 1, **kwargs}
    with pytest.raises(ParallelConfigError, match=rf"^{field} must be"):
        check_parallel_config(args.pop("world_size"), args.pop("tp"), **args)


# --- plans -------------------------------------------------------------------------------------


def test_unknown_style_is_refused_with_the_valid_ones():
    with pytest.raises(ParallelConfigError, match=r"'up': unknown style 'column'; use one of"):
        parse_plan({"up": "column"})


def test_fused_colwise_needs_segments():
    with pytest.raises(ParallelConfigError, match=r"fused_colwise needs 'segments'"):
        parse_plan({"qkv": {"style": "fused_colwise"}})


def test_heads_dim_is_read_for_head_norm_only():
    assert parse_plan({"q_norm": {"style": "head_norm", "heads_dim": 1}})[0].heads_dim == 1
    assert parse_plan({"q_norm": "head_norm"})[0].heads_dim == -2
    with pytest.raises(ParallelConfigError, match=r"'heads_dim' only applies to head_norm"):
        parse_plan({"norm": {"style": "norm", "heads_dim": 1}})


def test_segments_on_a_plain_style_are_refused():
    with pytest.raises(ParallelConfigError, match=r"only apply to fused_colwise"):
        parse_plan({"up": {"style": "colwise", "segments": [1, 1]}})


def test_star_matches_exactly_one_name_component():
    entry = parse_plan({"layers.*.mlp": "norm"})[0]
    assert entry.matches("layers.3.mlp")
    assert not entry.matches("layers.3.block.mlp")
    assert not entry.matches("layers.mlp")


def test_a_pattern_matching_no_module_is_refused():
    model = small_llama()
    plan = {**model.parallel_plan(), "layers.*.feed_forward.w1": "colwise"}
    with pytest.raises(ParallelConfigError, match=r"'layers.\*.feed_forward.w1' matches no module"):
        match_plan(model, plan)


def test_a_module_matched_by_two_patterns_is_refused():
    model = small_llama()
    plan = {**model.parallel_plan(), "layers.0.attention.o_proj": "colwise"}
    with pytest.raises(ParallelConfigError, match=r"'layers.0.attention.o_proj' matches both"):
        match_plan(model, plan)


def test_llama_plan_matches_every_projection_of_every_layer():
    model = small_llama()
    matched = match_plan(model, model.parallel_plan())
    assert matched["layers.1.attention.qkv_proj"].style == "fused_colwise"
    assert matched["layers.1.mlp.down_proj"].style == "rowwise"
    assert len(matched) == 3 + 6 * 2  # embed, final norm, head + 6 per block


def test_tp_not_dividing_fused_groups_is_refused_before_the_model_changes():
    model = small_llama(n_kv_heads=2)
    weight = model.layers[0].attention.qkv_proj.weight
    with pytest.raises(ParallelConfigError, match=r"tp 4 does not divide its 2 groups"):
        parallelize(model, dims_for(4), model.parallel_plan())
    assert model.layers[0].attention.qkv_proj.weight is weight


def test_tp_not_dividing_the_ffn_width_names_the_gate_up_groups():
    model = small_llama(n_heads=4, n_kv_heads=4, ffn_dim=130)
    with pytest.raises(ParallelConfigError) as refused:
        parallelize(model, dims_for(4), model.parallel_plan())
    message = str(refused.value)
    assert (
        "layers.0.mlp.gate_up_proj (fused_colwise): tp 4 does not divide its 130 groups" in message
    )
    assert "segments [1, 1]" in message and "pick tp dividing 130" in message
    assert "key/value" not in message


def test_fused_segments_that_do_not_add_up_to_the_layer_are_refused():
    model = small_llama()
    plan = model.parallel_plan()
    plan["layers.*.mlp.gate_up_proj"] = {"style": "fused_colwise", "segments": [1], "groups": 688}
    with pytest.raises(ParallelConfigError, match=r"= 688 rows, but the layer has 1376"):
        parallelize(model, dims_for(2), plan)


def test_rowwise_width_not_divisible_by_tp_is_refused():
    model = nn.Sequential(nn.Linear(6, 8))
    with pytest.raises(ParallelConfigError, match=r"0 \(rowwise\): in_features 6 is not divisible"):
        parallelize(model, dims_for(4), {"0": "rowwise"})


def test_wrong_module_type_for_a_style_is_refused():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ParallelConfigError, match=r"0 \(embedding\) must be an nn.Embedding"):
        parallelize(model, dims_for(2), {"0": "embedding"})


def test_tied_embeddings_are_refused_under_tensor_parallelism():
    model = small_llama(tie_embeddings=True)
    with pytest.raises(ParallelConfigError, match=r"tied embeddings"):
        parallelize(model, dims_for(2), model.parallel_plan())


class TiedLM(nn.Module):
    """Input and output embeddings sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize(
    "plan, needle",
    [
        ({"head": "lm_head"}, r"head\.weight is the same parameter as embed\.weight"),
        ({"embed": "embedding"}, r"embed\.weight is the same parameter as head\.weight"),
    ],
)
def test_a_planned_module_tied_to_one_outside_the_plan_is_refused_before_the_model_changes(
    plan, needle
):
    """Splitting one of two tied modules would give it its own (DTensor) weight, untying
    them silently."""
    model = TiedLM()
    with pytest.raises(ParallelConfigError, match=needle + r".*tied weights.*untie"):
        parallelize(model, dims_for(2), {"up": "colwise", "down": "rowwise", **plan})
    assert model.head.weight is model.embed.weight
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_a_0d_parameter_under_fsdp_is_refused_before_the_model_changes():
    """FSDP2 cannot shard a 0-d parameter; the refusal names it and the layouts that keep
    parameters whole, before any block is wrapped."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.scale = nn.Parameter(torch.tensor(1.0))

    model = Scaled()
    dims = dataclasses.replace(dims_for(1), dp=2, world_size=2)
    with pytest.raises(ParallelConfigError, match=r"scale is a 0-d parameter.*dp_shard='zero1'"):
        parallelize(model, dims, {})
    assert all(type(m).__name__ in ("Scaled", "ModuleList", "Linear") for m in model.modules())


def test_an_unknown_data_parallel_layout_is_refused_before_the_model_changes():
    model = small_llama()
    before = {n: type(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"dp_shard must be one of \('fsdp', 'zero1', 'none'\)"):
        parallelize(model, dims_for(1), model.parallel_plan(), dp_shard="zero2")
    assert {n: type(p) for n, p in model.named_parameters()} == before


def test_the_nxd_path_offers_only_zero1():
    model = small_llama()
    dims = dataclasses.replace(dims_for(1), backend="neuron", dp=2, world_size=2)
    with pytest.raises(ValueError, match="NeuronX Distributed's ZeRO-1; use dp_shard='zero1'"):
        parallelize(model, dims, model.parallel_plan(), dp_shard="fsdp")


# --- sequence parallelism: every module holding parameters is in the plan ---------------------


class NormedLM(nn.Module):
    """An embedding, two LayerNorms, an MLP and a head; ``scale`` a parameter of its own."""

    def __init__(self, scale: bool = False) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(64, 32), nn.LayerNorm(32)
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)
        self.norm2, self.head = nn.LayerNorm(32), nn.Linear(32, 64, bias=False)
        if scale:
            self.scale = nn.Parameter(torch.ones(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.head(self.norm2(h))


NORMED_PLAN = {"embed": "embedding", "norm": "norm", "up": "colwise", "down": "rowwise",
               "norm2": "norm", "head": "lm_head"}  # fmt: skip


def test_modules_with_parameters_outside_the_plan_are_refused_under_sequence_parallelism():
    # such a module runs on a sequence shard, and nothing sums its gradients over tp
    model = NormedLM()
    plan = {k: v for k, v in NORMED_PLAN.items() if k != "norm2"}
    weight = model.up.weight
    with pytest.raises(ParallelConfigError) as refused:
        parallelize(model, dims_for(2, sp=True), plan)
    message = str(refused.value)
    assert "sequence parallelism" in message and "norm2 holds parameters" in message
    assert "add them to the plan (a norm is 'norm'), or set sp=False" in message
    assert model.up.weight is weight  # refused before the model changed


def test_every_module_left_out_of_the_plan_is_named_under_sequence_parallelism():
    model = small_llama()
    plan = model.parallel_plan()
    del plan["layers.*.mlp_norm"], plan["norm"]
    with pytest.raises(
        ParallelConfigError, match=r"layers\.0\.mlp_norm, layers\.1\.mlp_norm, norm "
    ):
        parallelize(model, dims_for(2, sp=True), plan)


def test_a_parameter_of_the_model_itself_is_refused_under_sequence_parallelism():
    with pytest.raises(ParallelConfigError, match=r"NormedLM itself holds parameters"):
        parallelize(NormedLM(scale=True), dims_for(2, sp=True), NORMED_PLAN)


def test_modules_outside_the_plan_are_allowed_without_sequence_parallelism():
    plan = {k: v for k, v in NORMED_PLAN.items() if k != "norm2"}
    parallelize(NormedLM(), dims_for(1, sp=True), plan)  # tp 1: no sequence split
