"""The plan -> NeuronX Distributed translation, without NxD: constructor arguments per style
and the weight slice each rank loads."""

from __future__ import annotations

import pytest
import torch

from hlat_model import Llama, LlamaConfig
from hlat_parallel import ParallelConfigError, ParallelDims, match_plan, parallelize
from hlat_parallel.neuron_backend import nxd_layer, shard_weight


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


def test_sequence_parallel_on_the_neuron_backend_is_refused_for_batch_first_models(llama):
    dims = ParallelDims(
        world_size=2, rank=0, tp=2, dp=1, sp=True, backend="neuron",
        device=torch.device("cpu"), tp_rank=0, dp_rank=0,
    )  # fmt: skip
    with pytest.raises(ParallelConfigError, match=r"sequence-first|\[seq, batch, hidden\]"):
        parallelize(llama, dims, llama.parallel_plan())
