"""The neuron backend's pure parts: which shard each rank owns and how it is filled, the
refusal of tied embeddings, which gradients sequence parallelism sums over TP, the loss that
ignores padding labels, the precision and clip arguments of NxD's ZeRO-1, and the
initialisation of split weights (on real gloo groups).

Everything here runs with or without NxD installed: the checks tested run before NxD is
imported, the sums over TP run with a stand-in for the few NxD and torch-xla names they use,
and the rest is plain torch.
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawn import run_ranks

from hlat_model import Llama, LlamaConfig
from hlat_parallel import ParallelConfigError, ParallelDims, parallelize, shard_optimizer
from hlat_parallel.neuron_backend import (
    PRECISIONS,
    LocalShard,
    check_nxd_attributes,
    check_untied,
    init_sharded_weights,
    local_shard,
    masked_token_mean,
    shard_init,
    shard_weight,
    tp_seed,
    zero1_clip,
    zero1_grad_norm,
    zero1_precision,
)
from hlat_parallel.plan import match_plan

WORKER = Path(__file__).with_name("init_worker.py")


def neuron_dims(tp: int = 2, rank: int = 0, sp: bool = False) -> ParallelDims:
    return ParallelDims(
        world_size=tp, rank=rank, tp=tp, dp=1, sp=sp, backend="neuron",
        device=torch.device("cpu"), tp_rank=rank, dp_rank=0,
    )  # fmt: skip


# --- which slice each rank owns -------------------------------------------------------------


def nxd_layout(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int) -> torch.Tensor:
    """NxD's ``create_local_weight`` rule, restated: pieces of size/(tp*stride) along dim,
    rank r keeps pieces r, r + tp, r + 2 tp, ..."""
    pieces = torch.split(full, full.shape[dim] // (tp * stride), dim=dim)
    return torch.cat(pieces[rank::tp], dim=dim)


@pytest.mark.parametrize(("tp", "stride"), [(1, 1), (2, 1), (4, 1), (2, 3), (4, 2)])
@pytest.mark.parametrize("dim", [0, 1])
def test_each_rank_owns_the_slice_nxd_gives_it(tp, stride, dim):
    full = torch.arange(24 * 48.0).reshape(24, 48)
    for rank in range(tp):
        mine = local_shard(full.shape, dim, tp, rank, stride)
        expected = nxd_layout(full, dim, tp, rank, stride)
        assert mine.shape == tuple(expected.shape)
        held = torch.cat([full.narrow(dim, a, b - a) for a, b in mine.ranges], dim=dim)
        assert torch.equal(held, expected)
        assert torch.equal(shard_weight(full, dim, tp, rank, stride), expected)


def test_the_ranks_shards_tile_the_weight_exactly_once():
    shape, tp, stride = (32, 8), 4, 2
    rows = sorted(r for rank in range(tp) for a, b in local_shard(shape, 0, tp, rank, stride).ranges
                  for r in range(a, b))  # fmt: skip
    assert rows == list(range(32))


def test_a_replicated_weight_is_owned_whole_and_bad_splits_are_refused():
    assert local_shard((6, 4), None, 2, 1) == LocalShard((6, 4), None, ())
    with pytest.raises(ParallelConfigError, match="cannot split a dimension of 6 into 4 ranks"):
        local_shard((6, 4), 0, 4, 0)
    with pytest.raises(ParallelConfigError, match=r"TP rank 2 is outside 0\.\.1"):
        local_shard((6, 4), 0, 2, 2)


# --- how a shard is filled (the init_method NxD calls) --------------------------------------


def test_init_method_copies_this_ranks_slice_into_a_local_shard_parameter():
    source = torch.randn(8, 6)
    shard = torch.nn.Parameter(torch.zeros(4, 6))  # requires grad, as NxD's weight does
    shard_init(source, 0, 2, 1)(shard)
    assert torch.equal(shard.detach(), source[4:])
    row = torch.nn.Parameter(torch.zeros(8, 2))
    shard_init(source, 1, 3, 2)(row)
    assert torch.equal(row.detach(), source[:, 4:])


def test_init_method_fills_a_whole_cpu_master_weight_for_nxd_to_slice():
    source = torch.randn(8, 6, dtype=torch.bfloat16)
    master = torch.zeros(8, 6, dtype=torch.float32)  # NxD's CPU path draws an fp32 master
    shard_init(source, 0, 2, 1)(master)
    assert torch.equal(master, source.float())


def test_init_method_of_a_meta_weight_leaves_the_shard_for_the_models_init():
    with torch.device("meta"):
        source = torch.empty(8, 6)
    shard = torch.full((4, 6), 7.0)
    shard_init(source, 0, 2, 0)(shard)
    assert torch.equal(shard, torch.full((4, 6), 7.0))


def test_init_method_refuses_a_shape_the_plan_does_not_explain():
    with pytest.raises(ParallelConfigError, match=r"shape \(3, 6\).*TP rank 0 of 2 holds \(4, 6\)"):
        shard_init(torch.randn(8, 6), 0, 2, 0)(torch.zeros(3, 6))


# --- tied embeddings --------------------------------------------------------------------------


def test_tied_embeddings_are_refused_before_nxd_is_needed():
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("tiny", n_layers=1, tie_embeddings=True))
    with pytest.raises(ParallelConfigError, match=r"tie_embeddings=True.*tie_embeddings=False"):
        parallelize(model, neuron_dims(), model.parallel_plan())


class Tied(torch.nn.Module):
    """An embedding and a head sharing one weight, with no config flag saying so."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.head = torch.nn.Linear(4, 16, bias=False)
        self.head.weight = self.embed.weight


def test_a_weight_shared_between_swapped_modules_is_refused_without_a_config_flag():
    model = Tied()
    matched = match_plan(model, {"embed": "embedding", "head": "lm_head"})
    with pytest.raises(ParallelConfigError, match="embed and head share one weight"):
        check_untied(model, matched)
    untied = Llama(LlamaConfig.preset("tiny", n_layers=1))
    check_untied(untied, match_plan(untied, untied.parallel_plan()))


def test_a_swapped_module_tied_to_one_outside_the_plan_is_refused():
    model = Tied()
    matched = match_plan(model, {"head": "lm_head"})
    with pytest.raises(ParallelConfigError, match=r"head\.weight is the same parameter as embed"):
        check_untied(model, matched)


# --- which gradients sequence parallelism sums over TP -----------------------------------------

SUMMED = 7.0  # what the stand-in all-reduce returns, so a summed gradient is recognised


@pytest.fixture
def nxd_stand_in(monkeypatch) -> list:
    """NxD's parallel layers and torch-xla's all-reduce as far as ``parallelize`` uses them,
    on the CPU: the layers hold whole weights and tag them as NxD's do (a RowParallelLinear
    marks its bias ``sequence_parallel_enabled`` under SP); the all-reduce records its
    groups and returns :data:`SUMMED`."""
    calls: list = []

    def all_reduce(op: str, grad: torch.Tensor, groups: list) -> torch.Tensor:
        calls.append((op, groups))
        return torch.full_like(grad, SUMMED)

    def built(layer: torch.nn.Module, init_method) -> torch.nn.Module:
        init_method(layer.weight)
        layer.weight.tensor_model_parallel = True
        return layer

    # Note: the parameters hlat may pass, by the names, order and defaults of NxD's own
    # (neuronx_distributed/parallel_layers/layers.py, the commit nxd_standin.py names); no
    # catch-all, so a misspelt or unknown keyword fails here as on a trn1
    def row(
        input_size,
        output_size,
        bias=True,
        input_is_parallel=False,
        dtype=torch.float32,
        device=None,
        stride=1,
        init_method=None,
        sequence_parallel_enabled=False,
        sequence_dimension=None,
    ):
        # NxD asserts this: a sequence-parallel row layer takes its input split
        assert input_is_parallel or not sequence_parallel_enabled
        linear = torch.nn.Linear(input_size, output_size, bias=bias, device=device, dtype=dtype)
        layer = built(linear, init_method)
        if bias:
            layer.bias.sequence_parallel_enabled = sequence_parallel_enabled
        return layer

    def column(
        input_size,
        output_size,
        bias=True,
        gather_output=True,
        dtype=torch.float32,
        device=None,
        stride=1,
        init_method=None,
        sequence_parallel_enabled=False,
        sequence_dimension=None,
    ):
        linear = torch.nn.Linear(input_size, output_size, bias=bias, device=device, dtype=dtype)
        return built(linear, init_method)

    def embedding(
        num_embeddings,
        embedding_dim,
        padding_idx=None,
        max_norm=None,
        norm_type=2.0,
        scale_grad_by_freq=False,
        sparse=False,
        init_method=torch.nn.init.normal_,
        device=None,
        dtype=torch.float32,
        shard_across_embedding=False,
        pad=False,
        sequence_parallel_enabled=False,
        sequence_dimension=None,
    ):
        table = torch.nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype)
        return built(table, init_method)

    states: dict = {}
    tracker = types.SimpleNamespace(get_states=lambda: states, add=states.__setitem__)
    layers = types.SimpleNamespace(
        get_xla_rng_tracker=lambda: tracker,
        RowParallelLinear=row,
        ColumnParallelLinear=column,
        ParallelEmbedding=embedding,
        mappings=types.SimpleNamespace(scatter_to_sequence_parallel_region=lambda x: x),
        parallel_state=types.SimpleNamespace(
            get_tensor_model_parallel_group=lambda as_list=False: [[0, 1]]
        ),
    )
    xm = types.ModuleType("torch_xla.core.xla_model")
    xm.REDUCE_SUM, xm.all_reduce = "sum", all_reduce
    core = types.ModuleType("torch_xla.core")
    core.xla_model = xm
    xla = types.ModuleType("torch_xla")
    xla.core = core
    nxd = types.ModuleType("neuronx_distributed")
    nxd.parallel_layers = layers
    for name, module in [("torch_xla", xla), ("torch_xla.core", core), (xm.__name__, xm)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "neuronx_distributed", nxd)
    return calls


class SequenceFirstLM(torch.nn.Module):
    """A block with a LayerNorm (weight and bias) and biased linear layers, sequence-first."""

    sequence_first = True

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm = torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8)
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).transpose(0, 1)
        return h + self.down(torch.relu(self.up(self.norm(h))))


def test_sequence_parallelism_sums_every_norm_parameter_and_the_row_parallel_bias(nxd_stand_in):
    plan = {"embed": "embedding", "norm": "norm", "up": "colwise", "down": "rowwise"}
    model = parallelize(SequenceFirstLM(), neuron_dims(sp=True), plan)
    ids = torch.randint(0, 16, (2, 4))
    model(ids).sum().backward()
    # the partial gradients: both LayerNorm parameters and the bias added after the
    # row-parallel layer's reduce-scatter; a column-parallel bias is split, not partial
    expected = ["down.bias", "norm.bias", "norm.weight"]
    summed = sorted(n for n, p in model.named_parameters() if bool((p.grad == SUMMED).all()))
    assert summed == expected
    assert nxd_stand_in == [("sum", [[0, 1]])] * len(expected)  # each summed once
    for name in expected:  # NxD's ZeRO-1 and checkpoints read the tag
        assert model.get_parameter(name).sequence_parallel_enabled is True, name
    model(ids).sum().backward()  # a second forward attaches no second hook
    assert len(nxd_stand_in) == 2 * len(expected)


def test_the_embeddings_padding_row_reaches_the_nxd_layer_even_at_index_0(nxd_stand_in):
    """NxD's ParallelEmbedding drops a padding index of 0 itself; the swapped layer of the
    rank holding row 0 gets it back."""
    model = SequenceFirstLM()
    model.embed = torch.nn.Embedding(16, 8, padding_idx=0)
    parallelize(model, neuron_dims(), {"embed": "embedding", "up": "colwise", "down": "rowwise"})
    assert model.embed.padding_idx == 0


def test_without_sequence_parallelism_no_gradient_is_summed_over_tp(nxd_stand_in):
    plan = {"embed": "embedding", "norm": "norm", "up": "colwise", "down": "rowwise"}
    model = parallelize(SequenceFirstLM(), neuron_dims(sp=False), plan)
    model(torch.randint(0, 16, (2, 4))).sum().backward()
    assert nxd_stand_in == []


# --- the loss ignores padding labels ------------------------------------------------------------


def per_token_cross_entropy(seen: list[int]):
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen.append(int(labels.min()))
        # ignore_index=-1 would mask nothing here: every label reaching this is a class id
        flat = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
        return flat.view_as(labels)

    return loss


def test_masked_mean_equals_cross_entropy_with_ignore_index_in_value_and_gradient():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7))
    labels[0, 4:] = -100  # padding after a document
    labels[2, :2] = -100
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    seen: list[int] = []
    loss = masked_token_mean(per_token_cross_entropy(seen), logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-9)
    assert min(seen) >= 0  # -100 never reaches the per-token loss
    assert grad[0, 4:].abs().max() == 0 and grad[2, :2].abs().max() == 0


def test_the_mean_is_over_valid_labels_not_all_positions():
    logits = torch.zeros(1, 4, 2)  # every token costs log 2
    labels = torch.tensor([[0, 1, -100, -100]])
    loss = masked_token_mean(per_token_cross_entropy([]), logits, labels)
    assert loss.item() == pytest.approx(math.log(2))
    everything = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten())
    assert everything.item() == pytest.approx(math.log(2))  # same per-token cost, so:
    padded = torch.zeros(1, 4, 2)
    padded[0, 2:, 0] = 50.0  # padding positions that would cost 50 each if counted
    assert masked_token_mean(per_token_cross_entropy([]), padded, labels).item() == (
        pytest.approx(math.log(2))
    )


def test_a_batch_without_valid_labels_has_zero_loss_and_gradient():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    loss = masked_token_mean(per_token_cross_entropy([]), logits, torch.full((2, 3), -100))
    loss.backward()
    assert loss.item() == 0.0 and logits.grad is not None and logits.grad.abs().max() == 0


# --- precision and clipping arguments of NxD's ZeRO-1 -------------------------------------------


@pytest.mark.parametrize(
    ("mode", "param", "optimizer", "fp32_acc", "masters", "sr"),
    [
        ("bf16-sr", torch.bfloat16, torch.bfloat16, False, False, True),
        ("bf16", torch.bfloat16, torch.bfloat16, False, False, False),
        ("mixed", torch.bfloat16, torch.float32, True, True, False),
        ("fp32", torch.float32, torch.float32, False, False, False),
    ],
)
def test_each_precision_maps_to_zero1_dtypes_and_the_rounding_switch(
    mode, param, optimizer, fp32_acc, masters, sr
):
    p = zero1_precision(mode)
    assert (p.param_dtype, p.optimizer_dtype) == (param, optimizer)
    assert (p.fp32_grad_accumulation, p.save_master_weights, p.stochastic_rounding) == (
        fp32_acc,
        masters,
        sr,
    )
    assert p.zero1_kwargs() == {
        "optimizer_dtype": optimizer,
        "use_grad_acc_hook": fp32_acc,
        "higher_cc_precision": fp32_acc,
        "save_master_weights": masters,
    }
    assert p.description.startswith(f"{mode}: ") and "\n" not in p.description


def test_bf16_kahan_and_unknown_modes_are_refused_with_what_to_use():
    assert set(PRECISIONS) == {"bf16-sr", "bf16", "bf16-kahan", "mixed", "fp32"}
    with pytest.raises(ParallelConfigError, match=r"bf16-kahan is not available.*use bf16-sr"):
        zero1_precision("bf16-kahan")
    with pytest.raises(ParallelConfigError, match="unknown precision 'fp16'"):
        zero1_precision("fp16")


def test_the_configured_clip_always_reaches_zero1_and_zero_means_infinite():
    assert zero1_clip(1.0) == {"grad_clipping": True, "max_norm": 1.0}
    assert zero1_clip(0.3) == {"grad_clipping": True, "max_norm": 0.3}
    off = zero1_clip(0)
    assert off["grad_clipping"] is True and off["max_norm"] == math.inf
    assert zero1_clip(-1.0) == off


def test_zero1_without_dtype_or_max_norm_is_refused_before_anything_is_built():
    params = [torch.nn.Parameter(torch.zeros(4))]
    dims = neuron_dims()
    with pytest.raises(ParallelConfigError, match="needs optimizer_dtype="):
        shard_optimizer(torch.optim.AdamW, params, dims, lr=1e-3, **zero1_clip(1.0))
    kwargs = zero1_precision("bf16-sr").zero1_kwargs()
    with pytest.raises(ParallelConfigError, match="needs max_norm="):
        shard_optimizer(torch.optim.AdamW, params, dims, lr=1e-3, **kwargs)


def test_grad_norm_is_read_only_from_an_optimizer_that_computes_it():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(TypeError, match="AdamW has no grad_norm"):
        zero1_grad_norm(optimizer)


# --- initialising split weights ---------------------------------------------------------------


def test_lost_nxd_attributes_are_reported():
    layer = torch.nn.Linear(4, 4)
    layer._hlat_nxd_layer = True
    model = torch.nn.Sequential(layer)
    with pytest.raises(ParallelConfigError, match=r"0\.weight lost NxD's tensor_model_parallel"):
        check_nxd_attributes(model)
    with pytest.raises(ParallelConfigError, match="lost NxD's"):
        init_sharded_weights(model, neuron_dims(tp=1), seed=0)
    layer.weight.tensor_model_parallel = True
    check_nxd_attributes(model)


def test_one_rank_initialises_from_its_tp_seed_and_reseeds_after():
    def build() -> Llama:
        with torch.device("meta"):
            model = Llama(LlamaConfig.preset("tiny", n_layers=1))
        return model.to_empty(device="cpu")

    model = build()
    init_sharded_weights(model, neuron_dims(tp=1), seed=5)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))
    expected = build()
    torch.manual_seed(tp_seed(5, 0))
    expected.init_weights()
    for (name, p), q in zip(model.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_tp_ranks_draw_different_shards_and_agree_on_replicated_weights(tmp_path):
    run_ranks(WORKER, [str(tmp_path)], 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, value in ranks[0]["params"].items():
        other = ranks[1]["params"][name]
        if name in ranks[0]["split"]:
            assert not torch.equal(value, other), f"{name}: both TP ranks drew the same shard"
            for rank in range(2):  # each rank's shard is what its own TP seed draws
                assert torch.equal(ranks[rank]["params"][name], ranks[rank]["expected"][name])
        else:
            assert torch.equal(value, other), f"{name}: replicated weight differs over TP"
            assert torch.equal(value, ranks[0]["expected"][name])  # TP rank 0's values
    assert ranks[0]["split"] and len(ranks[0]["split"]) < len(ranks[0]["params"])
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])  # reseeded alike
