"""The plan -> NeuronX Distributed translation, without NxD: constructor arguments per style
and the weight slice each rank loads."""

from __future__ import annotations

import pytest
import torch

from hlat_model import Llama, LlamaConfig
from hlat_parallel import ParallelConfigError, ParallelDims, match_plan, parallelize
from hlat_parallel.neuron_backend import (
    NxdUnavailableError,
    local_padding_idx,
    nxd_layer,
    scatter_sequence,
    shard_weight,
)
from hlat_parallel.plan import PlanEntry, computes_sequence_first


@pytest.fixture(scope="module")
def llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset("tiny", n_layers=1, n_kv_heads=4))


def layer(model: Llama, name: str, tp: int = 2, sp: bool = True):
    matched = match_plan(model, model.parallel_plan())
    return nxd_layer(model.get_submodule(name), matched[name], tp, sp)


def test_fused_qkv_becomes_column_parallel_with_unit_stride_and_local_output(llama):
    spec = layer(llama, "layers.0.attention.qkv_proj")
    assert spec.cls == "ColumnParallelLinear"
    assert spec.kwargs == {
        "input_size": 256,
        "output_size": (8 + 2 * 4) * 32,
        "bias": False,
        "gather_output": False,
        "dtype": torch.float32,
        "sequence_parallel_enabled": True,
        "sequence_dimension": 0,
        "stride": 1,
    }
    assert spec.shard_dim == 0


def test_rowwise_becomes_row_parallel_with_parallel_input(llama):
    spec = layer(llama, "layers.0.mlp.down_proj")
    assert spec.cls == "RowParallelLinear"
    assert spec.kwargs["input_is_parallel"] is True
    assert (spec.kwargs["input_size"], spec.kwargs["output_size"]) == (688, 256)
    assert spec.shard_dim == 1


def test_embedding_becomes_parallel_embedding_over_the_vocabulary(llama):
    spec = layer(llama, "embed_tokens")
    assert spec.cls == "ParallelEmbedding"
    assert (spec.kwargs["num_embeddings"], spec.kwargs["embedding_dim"]) == (8192, 256)
    assert spec.shard_dim == 0


def test_embedding_lookup_options_that_differ_from_the_defaults_are_passed_on():
    table = torch.nn.Embedding(16, 4, padding_idx=-1, norm_type=1.0)
    spec = nxd_layer(table, PlanEntry("embed", "embedding"), 2, False)
    assert spec.kwargs == {
        "num_embeddings": 16, "embedding_dim": 4, "dtype": torch.float32,
        "sequence_parallel_enabled": False, "padding_idx": 15, "norm_type": 1.0,
    }  # fmt: skip
    normed = torch.nn.Embedding(16, 4, max_norm=1.5)
    assert nxd_layer(normed, PlanEntry("embed", "embedding"), 1, False).kwargs["max_norm"] == 1.5
    scaled = torch.nn.Embedding(16, 4, scale_grad_by_freq=True)
    assert nxd_layer(scaled, PlanEntry("embed", "embedding"), 1, False).kwargs["scale_grad_by_freq"]


@pytest.mark.parametrize(
    "options, needle",
    [
        (dict(sparse=True), "sparse=True"),
        (dict(scale_grad_by_freq=True), "scale_grad_by_freq"),
        (dict(max_norm=1.0), "max_norm=1.0"),
    ],
)
def test_embedding_options_parallel_embedding_cannot_honour_are_refused(options, needle):
    table = torch.nn.Embedding(16, 4, **options)
    with pytest.raises(ParallelConfigError, match=needle):
        nxd_layer(table, PlanEntry("embed", "embedding"), 2, False)


def test_head_norms_have_their_gradients_summed_over_tp_with_or_without_sp():
    norm = torch.nn.RMSNorm(8)
    entry = PlanEntry("q_norm", "head_norm")
    assert nxd_layer(norm, entry, 2, False).kwargs == {"sequence_parallel_enabled": True}
    assert nxd_layer(norm, entry, 1, False).kwargs == {"sequence_parallel_enabled": False}


def test_the_padding_row_is_local_to_the_rank_holding_it():
    assert [local_padding_idx(0, 16, 2, r) for r in range(2)] == [0, None]
    assert [local_padding_idx(9, 16, 2, r) for r in range(2)] == [None, 1]
    assert local_padding_idx(None, 16, 2, 0) is None


def test_lm_head_keeps_logits_vocab_parallel_for_parallel_cross_entropy(llama):
    spec = layer(llama, "lm_head")
    assert spec.cls == "ColumnParallelLinear"
    assert spec.kwargs["gather_output"] is False


def test_norms_are_marked_sequence_parallel_only_when_sp_is_on(llama):
    assert layer(llama, "norm", sp=True).kwargs == {"sequence_parallel_enabled": True}
    assert layer(llama, "norm", sp=False).kwargs == {"sequence_parallel_enabled": False}
    assert layer(llama, "norm", tp=1, sp=True).kwargs == {"sequence_parallel_enabled": False}


def test_qkv_row_shards_hold_whole_kv_groups(llama):
    weight = llama.layers[0].attention.qkv_proj.weight
    groups = weight.unflatten(0, (4, 2 + 2, 32))  # 4 KV groups of [q, q, k, v] heads
    for rank in range(2):
        expected = groups[2 * rank : 2 * rank + 2].flatten(0, 2)
        assert torch.equal(shard_weight(weight, 0, 2, rank), expected)


def test_row_parallel_shards_split_the_input_columns(llama):
    weight = llama.layers[0].mlp.down_proj.weight
    pieces = [shard_weight(weight, 1, 4, rank) for rank in range(4)]
    assert all(p.shape == (256, 172) for p in pieces)
    assert torch.equal(torch.cat(pieces, dim=1), weight)


def test_strided_shards_take_each_ranks_piece_of_every_segment():
    # [all q; all k; all v] with 2 rows each, split 2 ways with stride 3 (Megatron layout)
    weight = torch.arange(12.0).unflatten(0, (6, 2))
    assert torch.equal(shard_weight(weight, 0, 2, 0, stride=3), weight[[0, 2, 4]])
    assert torch.equal(shard_weight(weight, 0, 2, 1, stride=3), weight[[1, 3, 5]])


def test_uneven_split_is_refused():
    with pytest.raises(ParallelConfigError, match=r"cannot split a dimension of 6 into 4 ranks"):
        shard_weight(torch.zeros(6, 2), 0, 4, 0)


def _column(rows: int, sp: bool) -> dict:
    kwargs = {"input_size": 256, "output_size": rows, "bias": False, "gather_output": False}
    kwargs |= {"dtype": torch.float32, "sequence_parallel_enabled": sp}
    if sp:
        kwargs["sequence_dimension"] = 0
    return kwargs | {"stride": 1}


def _row(columns: int, sp: bool) -> dict:
    kwargs = {"input_size": columns, "output_size": 256, "bias": False, "input_is_parallel": True}
    kwargs |= {"dtype": torch.float32, "sequence_parallel_enabled": sp}
    return kwargs | ({"sequence_dimension": 0} if sp else {})


# module -> (class, kwargs, dimension of the weight this rank slices), with sp off and on
EXPECTED = {
    "embed_tokens": lambda sp: (
        "ParallelEmbedding",
        {"num_embeddings": 8192, "embedding_dim": 256, "dtype": torch.float32,
         "sequence_parallel_enabled": False},
        0,
    ),
    "layers.0.attention_norm": lambda sp: ("norm", {"sequence_parallel_enabled": sp}, None),
    "layers.0.attention.qkv_proj": lambda sp: ("ColumnParallelLinear", _column(512, sp), 0),
    "layers.0.attention.o_proj": lambda sp: ("RowParallelLinear", _row(256, sp), 1),
    "layers.0.mlp_norm": lambda sp: ("norm", {"sequence_parallel_enabled": sp}, None),
    "layers.0.mlp.gate_up_proj": lambda sp: ("ColumnParallelLinear", _column(2 * 688, sp), 0),
    "layers.0.mlp.down_proj": lambda sp: ("RowParallelLinear", _row(688, sp), 1),
    "norm": lambda sp: ("norm", {"sequence_parallel_enabled": sp}, None),
    "lm_head": lambda sp: ("ColumnParallelLinear", _column(8192, sp), 0),
}  # fmt: skip


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_plan_style_maps_to_its_nxd_layer_and_arguments(llama, name, sp):
    spec = layer(llama, name, tp=2, sp=sp)
    cls, kwargs, shard_dim = EXPECTED[name](sp)
    assert (spec.cls, spec.kwargs, spec.shard_dim, spec.stride) == (cls, kwargs, shard_dim, 1)
    # only the embedding output is split along the sequence afterwards: [B, S, H], dim 1
    scatter = 1 if sp and name == "embed_tokens" else None
    assert spec.scatter_output_dim == scatter


@pytest.mark.parametrize("name", list(EXPECTED))
def test_sequence_parallelism_needs_more_than_one_tp_rank(llama, name):
    assert layer(llama, name, tp=1, sp=True) == layer(llama, name, tp=1, sp=False)


def test_the_plan_covers_every_llama_layer_the_table_above_names(llama):
    assert set(match_plan(llama, llama.parallel_plan())) == set(EXPECTED)


def test_sequence_first_is_read_from_the_model_or_its_config():
    def model(sequence_first: bool) -> Llama:
        config = LlamaConfig.preset("tiny", n_layers=1, sequence_first=sequence_first)
        with torch.device("meta"):
            return Llama(config)

    assert computes_sequence_first(model(True))
    assert not computes_sequence_first(model(False))
    plain = torch.nn.Linear(2, 2)
    assert not computes_sequence_first(plain)
    plain.sequence_first = True
    assert computes_sequence_first(plain)


@pytest.mark.parametrize("tp", [2, 4])
def test_scatter_keeps_each_ranks_slice_of_the_sequence(tp):
    x = torch.arange(2 * 8 * 3.0).reshape(2, 8, 3)  # [B, S, H] as the embedding returns it
    rows = 8 // tp
    for rank in range(tp):

        def keep_mine(t: torch.Tensor, rank: int = rank) -> torch.Tensor:
            return t.chunk(tp, dim=0)[rank]  # what each TP rank keeps of dimension 0

        mine = scatter_sequence(x, 1, keep_mine)
        assert torch.equal(mine, x[:, rank * rows : (rank + 1) * rows])
        # turned sequence-first by the model, it is this rank's slice of the [S, B, H] layout
        assert torch.equal(mine.transpose(0, 1), x.transpose(0, 1)[rank * rows : (rank + 1) * rows])
        seq_first = x.transpose(0, 1).contiguous()  # [S, B, H]: dimension 0 is split as is
        assert torch.equal(scatter_sequence(seq_first, 0, keep_mine), mine.transpose(0, 1))


def _neuron_dims(sp: bool = True) -> ParallelDims:
    return ParallelDims(
        world_size=2, rank=0, tp=2, dp=1, sp=sp, backend="neuron",
        device=torch.device("cpu"), tp_rank=0, dp_rank=0,
    )  # fmt: skip


def test_sequence_parallel_on_the_neuron_backend_is_refused_for_batch_first_models(llama):
    with pytest.raises(ParallelConfigError) as refused:
        parallelize(llama, _neuron_dims(), llama.parallel_plan())
    message = str(refused.value)
    assert "computes sequence-first ([seq, batch, hidden]" in message
    assert "Llama computes batch-first" in message
    assert "LlamaConfig(sequence_first=True)" in message and "sp=False" in message


@pytest.mark.parametrize(
    ("sequence_first", "sp"), [(True, True), (False, False)], ids=["seq-first-sp", "batch-first"]
)
def test_supported_layouts_get_past_the_checks_to_nxd(sequence_first, sp):
    # What follows the checks is NxD: its import fails where it is not installed, and on a
    # CPU rank without NxD's parallel state its layers may fail or fall back to one rank.
    # Either way the layout itself must not be refused.
    config = LlamaConfig.preset("tiny", n_layers=1, sequence_first=sequence_first)
    model = Llama(config)
    try:
        parallelize(model, _neuron_dims(sp), model.parallel_plan())
    except NxdUnavailableError:
        pass
    except ParallelConfigError as refused:
        pytest.fail(f"a supported layout was refused: {refused}")
    except Exception:
        pass
