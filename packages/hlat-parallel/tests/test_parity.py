"""TP, TP+SP, DP and TP x DP give the single-process results, on real gloo groups, with each
data-parallel layout: FSDP, ZeRO-1 (parameters and gradients whole, optimizer state
sharded) and none (everything whole).

Each layout runs in spawned processes (tests/parity_worker.py) on three models: the `tiny`
Llama (cut to 2 layers and a 2048-token vocabulary, to keep the suite fast) with multi-head
attention and selective checkpointing, a GQA variant with full checkpointing, and a GQA
variant computing sequence-first ([S, B, H] activations). The tests below compare what the
ranks wrote with a single-process run of the same weights and batch: fp32, within 1e-5
relative (Frobenius norm of the difference). The README's quick-start: tests/test_readme.py.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from spawn import run_ranks

from hlat_model import Llama, LlamaConfig, cross_entropy_loss
from hlat_parallel.dims import _torch_version

pytestmark = [pytest.mark.slow, pytest.mark.parity]

WORKER = Path(__file__).with_name("parity_worker.py")
# Note: lr 1e-4 keeps Adam's amplification of fp32 noise in near-zero gradient elements
# (the update is about lr * sign(g) there) below the tolerance; every parameter still moves
# by more than 10 times the tolerance (norm weights about 2e-4 relative, matrices 1e-2).
STEPS, LR, MAX_NORM = 3, 1e-4, 1.0
BATCH, SEQ = 6, 32
TOL = 1e-5

CASES = {
    "mha": dict(checkpointing="selective"),
    "gqa": dict(n_kv_heads=2, checkpointing="full"),
    # [S, B, H] activations: under SP the sequence is split along dimension 0
    "seqfirst": dict(n_kv_heads=2, sequence_first=True),
}
# name: (world size, tp, sp, gradient-accumulation settings, dp_shard)
LAYOUTS = {
    "tp2": (2, 2, False, [1], "fsdp"),
    "tp2-sp": (2, 2, True, [1], "fsdp"),
    "dp2": (2, 1, False, [1, 3], "fsdp"),
    "tp2-sp-dp2": (4, 2, True, [1, 3], "fsdp"),
    "dp2-zero1": (2, 1, False, [1, 3], "zero1"),
    "dp2-none": (2, 1, False, [1], "none"),
    "tp2-sp-dp2-zero1": (4, 2, True, [1], "zero1"),
    "tp2-sp-dp2-none": (4, 2, True, [1], "none"),
}

try:  # hlat-optim's AdamW works on local shards, so it needs aligned gradient placements
    import hlat_optim  # noqa: F401

    OPTIMIZERS = ["torch", "hlat_optim"]
except Exception:
    OPTIMIZERS = ["torch"]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def _config(case: str) -> LlamaConfig:
    return LlamaConfig.preset("tiny", n_layers=2, vocab_size=2048, **CASES[case])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """Initial weights and a batch per case, shared by the reference and every layout."""
    out = {}
    for index, case in enumerate(CASES):
        torch.manual_seed(index)
        config = _config(case)
        model = Llama(config)
        tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1))
        out[case] = {
            "config": config.to_dict(),
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "tokens": tokens,
        }
    return out


def exact_clip_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Gradient clipping with the norm summed in float64: the single-process truth.

    Note: ``torch.nn.utils.clip_grad_norm_`` (fp32 ``_foreach_norm`` on CPU) returns a norm
    about 4e-5 relative away from the float64 value for this model, more than the tolerance.
    """
    norm = torch.stack([p.grad.double().pow(2).sum() for p in params]).sum().sqrt()
    coef = min(1.0, max_norm / (norm.item() + 1e-6))
    for p in params:
        p.grad.mul_(coef)
    return norm.float()


def _reference(case: dict, optimizer_cls) -> dict:
    model = Llama(LlamaConfig(**case["config"]))
    model.load_state_dict(case["state"])
    optimizer = optimizer_cls(model.parameters(), lr=LR)
    tokens = case["tokens"]
    out: dict = {}
    for step in range(STEPS):
        logits = model(tokens[:, :-1])
        loss = cross_entropy_loss(logits, tokens[:, 1:])
        loss.backward()
        if step == 0:
            out["logits"], out["loss"] = logits.detach(), loss.detach()
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            out["norm"] = exact_clip_(list(model.parameters()), MAX_NORM)
            out["clipped"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        else:
            exact_clip_(list(model.parameters()), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["numel"] = sum(p.numel() for p in model.parameters())
    return out


@pytest.fixture(scope="module")
def reference(inputs) -> dict:
    """Single-process results per (case, optimizer)."""
    classes = {"torch": torch.optim.AdamW}
    if "hlat_optim" in OPTIMIZERS:
        from hlat_optim import AdamW

        classes["hlat_optim"] = functools.partial(AdamW, impl="reference")
    return {
        (case, opt): _reference(inputs[case], classes[opt])
        for case in inputs
        for opt in OPTIMIZERS
        if case == "mha" or opt == "torch"
    }


def launch(workdir: Path, world: int, tp: int, layouts: list) -> None:
    """Start ``world`` worker processes with torchrun's environment and wait for them;
    ``layouts``: [dp_shard, sp, gradient-accumulation settings] each."""
    run_ranks(WORKER, [str(workdir), str(tp), json.dumps(layouts)], world)


@pytest.fixture(scope="module")
def launches(inputs, tmp_path_factory) -> dict:
    """Per-rank results of each spawned group, keyed by (world, tp); a group runs every
    layout that shares its world size and tp (with and without SP). Filled on first use."""
    cache: dict = {}

    def run(world: int, tp: int) -> dict:
        if (world, tp) in cache:
            return cache[(world, tp)]
        mine = [v for v in LAYOUTS.values() if v[:2] == (world, tp)]
        accumulate = sorted({acc for _, _, _, accs, _ in mine for acc in accs})
        workdir = tmp_path_factory.mktemp(f"world{world}-tp{tp}")
        for case, data in inputs.items():
            # hlat-optim on one model is enough to show it works on DTensor shards
            runs = [("torch", acc) for acc in accumulate]
            if case == "mha":
                runs += [(opt, 1) for opt in OPTIMIZERS if opt != "torch"]
            torch.save({**data, "runs": runs}, workdir / f"input-{case}.pt")
        launch(workdir, world, tp, [[shard, sp, accs] for _, _, sp, accs, shard in mine])
        results: dict = {}
        for path in workdir.glob("*-rank*.pt"):
            shard, sp, case, opt, acc, rank = path.stem.split("-")
            key = (shard, sp == "sp1", case, opt, int(acc[3:]))
            results.setdefault(key, {})[int(rank[4:])] = torch.load(path, weights_only=False)
        shutil.rmtree(workdir)  # loaded: the per-rank files (GBs over all groups) go now
        cache[(world, tp)] = results
        return results

    return run


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, launches) -> dict:
    """One layout's per-rank results keyed by (case, optimizer, accumulation)."""
    name = request.param
    world, tp, sp, accumulate, dp_shard = LAYOUTS[name]
    results = {
        key[2:]: ranks
        for key, ranks in launches(world, tp).items()
        if key[:2] == (dp_shard, sp) and key[4] in accumulate
    }
    return {
        "name": name,
        "world": world,
        "tp": tp,
        "sp": sp,
        "dp_shard": dp_shard,
        "results": results,
    }


def _runs(layout: dict, accumulate: int = 1):
    for (case, opt, acc), ranks in sorted(layout["results"].items()):
        if acc == accumulate:
            assert len(ranks) == layout["world"]
            yield case, opt, ranks


def test_logits_match_single_process(layout, reference):
    for case, opt, ranks in _runs(layout):
        ref = reference[(case, opt)]["logits"]
        for rank, out in ranks.items():
            rows = BATCH // (layout["world"] // layout["tp"])
            expected = ref[out["dp_rank"] * rows : (out["dp_rank"] + 1) * rows]
            error = relative_error(out["logits"], expected)
            assert error < TOL, (
                f"{layout['name']} {case} {opt} rank {rank}: logits off by {error:.2e}"
            )


def test_loss_matches_single_process(layout, reference):
    for case, opt, ranks in _runs(layout):
        for rank, out in ranks.items():
            error = relative_error(out["loss"], reference[(case, opt)]["loss"])
            assert error < TOL, f"{layout['name']} {case} rank {rank}: loss off by {error:.2e}"


def test_gathered_gradients_match_single_process(layout, reference):
    for case, opt, ranks in _runs(layout):
        ref = reference[(case, opt)]["grads"]
        for name, expected in ref.items():
            error = relative_error(ranks[0]["grads"][name], expected)
            assert error < TOL, f"{layout['name']} {case}: grad of {name} off by {error:.2e}"


def test_clip_norm_equals_single_process_norm_and_scales_gradients(layout, reference):
    for case, opt, ranks in _runs(layout):
        ref = reference[(case, opt)]
        for rank, out in ranks.items():
            error = relative_error(out["norm"], ref["norm"])
            assert error < TOL, f"{layout['name']} {case} rank {rank}: norm off by {error:.2e}"
        assert ref["norm"] > MAX_NORM  # so that clipping really scaled the gradients
        for name, expected in ref["clipped"].items():
            assert relative_error(ranks[0]["clipped"][name], expected) < TOL, name


@pytest.mark.parametrize("accumulate", [1, 3])
def test_parameters_after_three_steps_match_single_process(layout, reference, inputs, accumulate):
    runs = list(_runs(layout, accumulate))
    if accumulate > 1 and not runs:
        pytest.skip(f"{layout['name']} runs without gradient accumulation")
    assert runs
    for case, opt, ranks in runs:
        ref = reference[(case, opt)]["params"]
        initial = inputs[case]["state"]
        moved = min(relative_error(ref[n], initial[n]) for n in ref)
        assert moved > 10 * TOL  # the steps changed every parameter well beyond the tolerance
        for rank, out in ranks.items():
            for name, expected in ref.items():
                error = relative_error(out["params"][name], expected)
                assert error < TOL, (
                    f"{layout['name']} {case} {opt} acc {accumulate} rank {rank}: "
                    f"{name} off by {error:.2e}"
                )


def test_fused_shards_hold_matching_qkv_and_gate_up_slices(layout, inputs):
    if layout["world"] != layout["tp"]:
        pytest.skip("checked where each rank holds a whole TP shard (dp 1)")
    tp = layout["tp"]
    for case, _, ranks in _runs(layout):
        config = _config(case)
        state = inputs[case]["state"]
        groups, per, hd = config.kv_heads, config.q_per_kv, config.head_dim
        qkv = state["layers.0.attention.qkv_proj.weight"].unflatten(0, (groups, per + 2, hd))
        gate_up = state["layers.0.mlp.gate_up_proj.weight"].unflatten(0, (config.ffn_dim, 2))
        for rank, out in ranks.items():
            r = out["dims"]["tp_rank"]
            g = groups // tp
            # whole KV groups: this rank's q heads next to the k and v heads they attend with
            expected_qkv = qkv[r * g : (r + 1) * g].flatten(0, 2)
            f = config.ffn_dim // tp
            expected_gate_up = gate_up[r * f : (r + 1) * f].flatten(0, 1)  # gate_i beside up_i
            fused = out["fused"]
            assert torch.equal(fused["layers.0.attention.qkv_proj.weight"], expected_qkv), rank
            assert torch.equal(fused["layers.0.mlp.gate_up_proj.weight"], expected_gate_up), rank


def test_each_rank_holds_its_share_of_optimizer_state(layout, reference):
    dp = layout["world"] // layout["tp"]
    for case, opt, ranks in _runs(layout):
        total_state = 2 * reference[(case, opt)]["numel"]  # AdamW: exp_avg and exp_avg_sq
        for rank, out in ranks.items():
            share = out["state_numel"] / total_state
            # 1/dp of this rank's TP shard (fsdp, zero1) or the whole TP shard (none);
            # replicated norm weights add a little under TP
            expected = 1 / (layout["tp"] if layout["dp_shard"] == "none" else layout["world"])
            assert expected * 0.98 < share < expected * 1.05, (
                f"{layout['name']} {case} rank {rank}: holds {share:.4f} of the state, "
                f"expected about {expected:.4f} (1/{dp} of a 1/{layout['tp']} TP shard)"
            )


def test_zero1_state_saved_with_dcp_loads_into_fsdp(layout):
    if layout["dp_shard"] != "zero1":
        pytest.skip("zero1 layouts")
    for case, _, ranks in _runs(layout):
        for rank, out in ranks.items():
            # the same values, moved from ZeRO-1's slices into FSDP's shards by DCP
            assert out["reshard_error"] < 1e-7, (case, rank, out["reshard_error"])


def test_shard_optimizer_refuses_parameters_not_sharded_over_dp(layout):
    if layout["world"] == layout["tp"] or layout["dp_shard"] != "fsdp":
        pytest.skip("dp is 1, or not fsdp")
    for _, _, ranks in _runs(layout):
        message = ranks[0]["refused"]
        assert "is not sharded over dp" in message and "call parallelize" in message


def test_gradient_accumulation_communicates_only_on_the_final_micro_step(layout):
    if layout["name"] not in ("dp2", "dp2-zero1"):
        pytest.skip("counted where every collective is a data-parallel one (tp 1)")
    for (_, _, acc), ranks in layout["results"].items():
        if acc != 3:
            continue
        for rank, out in ranks.items():
            first, middle, final, sync, step = out["comms"]
            if layout["dp_shard"] == "fsdp":
                # the first micro-step gathers the parameters once; nothing is reduced
                # before the final micro-step, which reduce-scatters the gradients
                assert set(first) == {"all_gather"}, (rank, first)
                assert middle == {}, (rank, middle)
                assert final.get("reduce_scatter", 0) > 0, (rank, final)
                assert "all_gather" not in final, (rank, final)
                assert sync == {} and step == {}, (rank, sync, step)
            else:
                # ZeRO-1: no micro-step communicates; one bucketed all-reduce of the
                # gradients, then the step's all-gather of the updated slices
                assert first == middle == final == {}, (rank, first, middle, final)
                assert set(sync) == {"all_reduce"}, (rank, sync)
                assert set(step) == {"all_gather"}, (rank, step)


def test_sequence_not_divisible_by_tp_is_refused_at_forward_under_sp(layout):
    if not layout["sp"]:
        pytest.skip("sequence parallelism is off")
    for _, _, ranks in _runs(layout):
        for out in ranks.values():
            assert "got a sequence of 31 tokens; feed a multiple of 2" in out["odd_sequence"]


# --- FSDP beside the Llama runs: nested lists, and the bytes CollectiveLog counts ------------

FSDP_WORKER = Path(__file__).with_name("fsdp_worker.py")


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory) -> list[dict]:
    """tests/fsdp_worker.py on two ranks (dp 2): what each wrote, and its input."""
    from fsdp_worker import Nested, pair

    workdir = tmp_path_factory.mktemp("fsdp")
    torch.manual_seed(0)
    data = {
        "nested": Nested().state_dict(),
        "pair": pair().state_dict(),
        "x": torch.randn(4, 8),
    }
    torch.save(data, workdir / "input.pt")
    run_ranks(FSDP_WORKER, [str(workdir)], 2)
    return [data] + [torch.load(workdir / f"rank{r}.pt") for r in range(2)]


def test_blocks_holding_their_own_lists_shard_below_their_block_and_match_one_process(
    fsdp_ranks,
):
    from fsdp_worker import Nested

    data, *ranks = fsdp_ranks
    reference = Nested()
    reference.load_state_dict(data["nested"])
    reference(data["x"]).sum().div(2).backward()  # FSDP averages the ranks' sums
    blocks = [f"layers.{i}" for i in range(2)]
    expected_units = ["", *blocks, *(f"{b}.sub.{j}" for b in blocks for j in range(2))]
    for rank, out in enumerate(ranks):
        # the root, and every block and sub-layer in a unit of its own
        assert out["nested"]["units"] == sorted(expected_units), rank
        for name, param in reference.named_parameters():
            error = relative_error(out["nested"]["grads"][name], param.grad)
            assert error < TOL, f"rank {rank}: grad of {name} off by {error:.2e}"


def test_collective_log_counts_the_bytes_of_fsdp_and_torch_distributed_collectives(fsdp_ranks):
    data, *ranks = fsdp_ranks
    whole = sum(t.numel() * t.element_size() for t in data["pair"].values())
    piece = 8 * 4  # fsdp_worker.N fp32 elements per rank
    expected_direct = {
        "all_reduce": [("all_reduce", piece, 2)],
        "all_gather": [("all_gather", 2 * piece, 2)],
        "all_gather_into_tensor": [("all_gather", 2 * piece, 2)],
        "reduce_scatter_tensor": [("reduce_scatter", 2 * piece, 2)],
        "gather": [("gather", 2 * piece, 2)],
        "scatter": [("scatter", 2 * piece, 2)],
    }
    for rank, out in enumerate(ranks):
        # one unit: the forward gathers every parameter once, the backward reduce-scatters
        # every gradient once, each over the 2 ranks
        assert out["fsdp_calls"] == [("all_gather", whole, 2), ("reduce_scatter", whole, 2)], (
            rank,
            whole,
        )
        assert out["direct_calls"] == expected_direct, rank


# --- a model that is not hlat-model's ---------------------------------------------------------

HF_WORKER = Path(__file__).with_name("hf_worker.py")


@pytest.mark.skipif(
    _torch_version() < (2, 13),
    reason="torch 2.9's DTensor has no sharding rule for the alias that transformers' "
    "Llama makes of its last hidden state (aten.alias.default); passes with torch 2.13",
)
def test_a_hugging_face_llama_under_tp2_and_sp_matches_one_process(tmp_path):
    """transformers' ``LlamaForCausalLM`` with a plan for its module names, trained three
    steps at TP 2 with sequence parallelism (its positions passed, as the README says):
    the single process's losses and gradient norms."""
    pytest.importorskip("transformers")
    run_ranks(HF_WORKER, [str(tmp_path / "one.json"), "1"], 1)
    run_ranks(HF_WORKER, [str(tmp_path / "tp2.json"), "2"], 2)
    one = json.loads((tmp_path / "one.json").read_text())
    tp2 = json.loads((tmp_path / "tp2.json").read_text())
    assert len(one["losses"]) == 3 and one["losses"][-1] < one["losses"][0]
    for key in ("losses", "norms"):
        torch.testing.assert_close(
            torch.tensor(tp2[key]), torch.tensor(one[key]), rtol=1e-5, atol=0
        )


QWEN3_WORKER = Path(__file__).with_name("qwen3_worker.py")


@pytest.mark.skipif(
    _torch_version() < (2, 13),
    reason="transformers' Qwen3 slices its last hidden state through the same "
    "slice_logits_to_keep as its Llama (the test above): an alias torch 2.9's DTensor has "
    "no sharding rule for (aten.alias.default)",
)
def test_a_hugging_face_qwen3_with_head_norms_under_tp2_matches_one_process():
    """transformers' ``Qwen3ForCausalLM`` normalises each query and key head between the
    colwise and rowwise projections (``q_norm``, ``k_norm``, planned ``head_norm``): at TP 2,
    with and without sequence parallelism, the loss and every gradient (the head norms',
    summed over tp, included) are the single process's."""
    pytest.importorskip("transformers")
    run_ranks(QWEN3_WORKER, [], 2)  # without SP, then with it
