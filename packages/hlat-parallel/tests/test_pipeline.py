"""Pipeline parallelism: the stage split, the stage modules and every offered schedule.

The split, the schedule checks and the bubble fractions are pure; the stage modules are
checked in one process (chained, they are the model); each schedule runs on two spawned
gloo processes (PP2) and on four (PP2 x TP2 with sequence parallelism), see
tests/pipeline_worker.py, training a 4-layer GQA Llama with packed documents for two SGD
steps, compared with one process on the same batch: fp32, within 1e-5 relative. Each
layout is one spawned job running every schedule in turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pipeline_worker import llama_block_args
from spawn import run_ranks
from torch import nn

from hlat_model import Llama, LlamaConfig, cross_entropy_loss
from hlat_parallel import (
    SCHEDULES,
    ParallelConfigError,
    StageSplit,
    bubble_fraction,
    build_pipeline,
    check_microbatches,
    check_schedule,
    match_plan,
    rank_module,
    split_layers,
    stage_ids,
    stage_modules,
    stage_plan,
)
from hlat_parallel.dims import PIPELINE_MIN_TORCH, _torch_version

pytestmark = pytest.mark.parity

WORKER = Path(__file__).with_name("pipeline_worker.py")
OLD_TORCH = _torch_version() < PIPELINE_MIN_TORCH
needs_pipeline_torch = pytest.mark.skipif(
    OLD_TORCH, reason="pipeline parallelism needs torch>={}.{}".format(*PIPELINE_MIN_TORCH)
)
TOL = 1e-5
STEPS, LR, N_MICRO = 2, 0.5, 4
# layout -> (tensor-parallel degree, micro-batches); pp = processes / tp = 2. PP2 x TP2 runs
# 2 micro-batches of 2 rows (the fewest every schedule accepts at pp 2), the same batch.
LAYOUTS = {"pp2": (1, N_MICRO), "pp2xtp2": (2, 2)}
# (schedule, explicit block counts per stage or None for the balance rule)
RUNS = [
    ("1F1B", None),
    ("GPipe", [1, 3]),
    ("Interleaved1F1B", None),  # balance rule: [0, 1, 2, 1], an embedding-only stage
    ("InterleavedZeroBubble", [1, 1, 1, 1]),
    ("ZBVZeroBubble", None),
]


def counts(splits: list[StageSplit]) -> list[int]:
    return [len(s.layers) for s in splits]


def costs(splits: list[StageSplit], pre: float = 1.0, post: float = 1.0) -> list[float]:
    return [len(s.layers) + pre * s.first + post * s.last for s in splits]


# ---- split_layers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_layers", "n_stages"),
    [(n, s) for n in range(1, 40) for s in (1, 2, 3, 4, 8) if n >= s - 2],
)
def test_balanced_split_costs_differ_by_at_most_one_block(n_layers, n_stages):
    splits = split_layers(n_layers, n_stages)
    assert [s.index for s in splits] == list(range(n_stages))
    assert [i for s in splits for i in s.layers] == list(range(n_layers))  # in order, once
    assert max(costs(splits)) - min(costs(splits)) <= 1
    assert all(s.layers for s in splits[1:-1])


def test_embedding_on_first_stage_and_head_on_last():
    splits = split_layers(8, 4)
    assert [(s.first, s.last) for s in splits] == [
        (True, False),
        (False, False),
        (False, False),
        (False, True),
    ]
    assert split_layers(3, 1) == [StageSplit(0, (0, 1, 2), True, True)]


def test_embedding_and_head_count_as_block_equivalents():
    assert counts(split_layers(32, 4)) == [7, 8, 9, 8]
    assert counts(split_layers(32, 4, pre_cost=0, post_cost=0)) == [8, 8, 8, 8]
    assert counts(split_layers(6, 4)) == [1, 2, 2, 1]
    # a head costing more than a stage's share gets the last stage to itself
    assert counts(split_layers(4, 3, post_cost=4)) == [1, 3, 0]
    assert counts(split_layers(8, 2, pre_cost=0.5, post_cost=2.5)) == [5, 3]


def test_equal_costs_give_the_extra_block_to_the_later_stage():
    assert counts(split_layers(5, 2)) == [2, 3]
    assert counts(split_layers(3, 2, pre_cost=0, post_cost=0)) == [1, 2]


def test_middle_stages_get_a_block_before_free_first_and_last_stages():
    assert counts(split_layers(2, 4, pre_cost=0, post_cost=0)) == [0, 1, 1, 0]


def test_explicit_split_overrides_the_balance_rule():
    splits = split_layers(8, 3, split=[1, 6, 1])
    assert [s.layers for s in splits] == [(0,), (1, 2, 3, 4, 5, 6), (7,)]
    assert counts(split_layers(4, 3, split=[0, 4, 0])) == [0, 4, 0]


@pytest.mark.parametrize(
    ("n_layers", "n_stages", "split", "message"),
    [
        (8, 3, [4, 4], "has 2 entries for 3 stages"),
        (8, 2, [4, 5], "holds 9 blocks but the model has 8"),
        (8, 3, [4, 0, 4], "stage 1 holds no block"),
        (8, 2, [9, -1], "entry 1 must be a block count >= 0"),
        (8, 2, [4.0, 4], "entry 0 must be a block count"),
        (3, 6, None, "3 blocks cannot fill 6 pipeline stages"),
        (0, 2, None, "n_layers must be a positive integer"),
        (4, 0, None, "n_stages must be a positive integer"),
    ],
)
def test_bad_splits_are_refused_with_the_reason(n_layers, n_stages, split, message):
    with pytest.raises(ParallelConfigError, match=message):
        split_layers(n_layers, n_stages, split=split)


def test_negative_block_cost_is_refused():
    with pytest.raises(ParallelConfigError, match="post_cost must be a number >= 0"):
        split_layers(4, 2, post_cost=-1)


# ---- stage placement, schedule checks, bubbles ----------------------------------------------


def test_looped_placement_and_v_placement():
    assert stage_ids(1, 4) == [1]
    assert stage_ids(1, 4, 2) == [1, 5]
    assert stage_ids(0, 4, 2, style="v") == [0, 7]
    assert stage_ids(3, 4, 2, style="v") == [3, 4]
    with pytest.raises(ParallelConfigError, match="exactly 2 stages per rank"):
        stage_ids(0, 4, 3, style="v")
    with pytest.raises(ParallelConfigError, match=r"pp_rank 4 is outside 0\.\.3"):
        stage_ids(4, 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("PipeDream", 2, 1, 4), "unknown pipeline schedule 'PipeDream'"),
        (("1F1B", 2, 2, 4), "runs one stage per rank"),
        (("ZBVZeroBubble", 2, 1, 4), "exactly 2 stages per rank"),
        (("1F1B", 4, 1, 2), "n_microbatches 2 < pp 4"),
        (("Interleaved1F1B", 4, 2, 9), "must be a multiple of 2"),
        (("GPipe", 2, 1, 0), "n_microbatches must be a positive integer"),
    ],
)
def test_schedule_checks_refuse_layouts_torch_cannot_run(args, message):
    with pytest.raises(ParallelConfigError, match=message):
        check_schedule(*args)


def test_every_offered_schedule_passes_its_own_checks():
    for name in SCHEDULES:
        virtual = 1 if name in ("1F1B", "GPipe") else 2
        check_schedule(name, 4, virtual, 8)


def test_a_batch_the_micro_batches_do_not_divide_is_refused_with_its_name():
    batch = torch.zeros(8, 5)
    check_microbatches(4, (batch,), {"target": batch, "doc_lens": [batch], "losses": []})
    check_microbatches(4, (), {"scale": torch.tensor(2.0), "return_outputs": False})  # 0-d
    with pytest.raises(
        ParallelConfigError, match=r"n_microbatches=3 .* positional argument 0 has 8 rows"
    ):
        check_microbatches(3, (batch,), {})
    with pytest.raises(ParallelConfigError, match=r"but target has 6 rows .*multiple of 4 rows"):
        check_microbatches(4, (), {"target": batch[:6]})
    with pytest.raises(ParallelConfigError, match="but doc_lens has 2 rows"):
        check_microbatches(4, (), {"doc_lens": [batch[:2]]})


def test_bubble_fractions_follow_the_papers():
    assert bubble_fraction("GPipe", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("1F1B", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("Interleaved1F1B", 4, 8, virtual=2) == pytest.approx(3 / 16)
    assert bubble_fraction("InterleavedZeroBubble", 4, 8, virtual=2) == pytest.approx(1 / 16)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, virtual=2) == 0.0
    assert bubble_fraction("1F1B", 1, 8) == 0.0
    with pytest.raises(ParallelConfigError, match="one stage per rank"):
        bubble_fraction("1F1B", 4, 8, virtual=2)


# ---- stage modules, one process --------------------------------------------------------------


def small_config(**overrides) -> LlamaConfig:
    fields = dict(n_layers=4, vocab_size=256, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    return LlamaConfig.preset("tiny", max_seq_len=64, **{**fields, **overrides})


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(small_config())


def test_stage_parameter_names_are_the_model_names(model):
    splits = split_layers(4, 3)
    modules = stage_modules(model, splits, range(3))
    names = [[n for n, _ in m.named_parameters()] for m in modules]
    assert names[0][0] == "embed_tokens.weight"
    assert names[-1][-2:] == ["norm.weight", "lm_head.weight"]
    assert sorted(n for ns in names for n in ns) == sorted(n for n, _ in model.named_parameters())
    for module in modules:  # shared, not copied
        for name, param in module.named_parameters():
            assert param is model.get_parameter(name)


def test_state_dicts_of_the_stages_load_into_the_whole_model(model):
    modules = stage_modules(model, split_layers(4, 4), range(4))
    merged = {k: v for m in modules for k, v in m.state_dict().items()}
    fresh = Llama(small_config())
    fresh.load_state_dict(merged, strict=True)
    for name, param in model.named_parameters():
        assert torch.equal(fresh.get_parameter(name), param)


def test_a_rank_module_holds_its_stages_under_the_model_names(model):
    splits = split_layers(4, 4)
    # rank 0 of pp 2 with two stages per rank: stages 0 and 2
    modules = stage_modules(model, splits, stage_ids(0, 2, 2))
    held = rank_module(modules)
    keys = list(held.state_dict())
    expected = [k for m in modules for k in m.state_dict()]
    assert sorted(keys) == sorted(expected) and keys[0] == "embed_tokens.weight"
    assert "lm_head.weight" not in keys  # stage 3 is on rank 1
    for name, param in held.named_parameters():
        assert param is model.get_parameter(name)
    with pytest.raises(RuntimeError, match="schedule"):
        held(torch.zeros(1, 4, dtype=torch.long))


def test_a_stage_plan_keeps_the_entries_of_the_modules_the_stage_holds(model):
    plan = model.parallel_plan()
    first, middle, last = stage_modules(model, split_layers(4, 3), range(3))
    assert "embed_tokens" in stage_plan(plan, first) and "lm_head" not in stage_plan(plan, first)
    kept = stage_plan(plan, middle)
    assert "embed_tokens" not in kept and "norm" not in kept and "lm_head" not in kept
    assert set(kept) == {p for p in plan if p.startswith("layers.")}
    assert {"norm", "lm_head"} <= set(stage_plan(plan, last))
    match_plan(middle, kept)  # every kept pattern matches a module of the stage


def test_a_stage_plan_refuses_a_pattern_that_matches_no_module_of_the_model(model):
    # a mistyped norm pattern, dropped from every stage, would leave the norms unsplit
    plan = model.parallel_plan()
    plan["layers.*.mlp_nrom"] = plan.pop("layers.*.mlp_norm")
    for stage in stage_modules(model, split_layers(4, 3), range(3)):
        with pytest.raises(
            ParallelConfigError, match=r"'layers.\*.mlp_nrom' matches no module of Llama"
        ):
            stage_plan(plan, stage)
    plan["layers.1.mlp.down_proj"] = "colwise"  # and, as match_plan, one module two patterns
    del plan["layers.*.mlp_nrom"]
    first = stage_modules(model, split_layers(4, 3), [0])[0]  # holds no block 1
    with pytest.raises(ParallelConfigError, match=r"'layers.1.mlp.down_proj' matches both"):
        stage_plan(plan, first)


def test_chained_stages_compute_the_model_with_packed_documents(model):
    tokens = torch.randint(0, 256, (2, 16))
    doc_lens = torch.tensor([[9, 7], [16, 0]])
    block_args = llama_block_args(model.config)
    modules = stage_modules(model, split_layers(4, 3), range(3), block_args=block_args)
    h = tokens
    for module in modules:
        h = module(h, doc_lens=doc_lens)
    expected = model(tokens, doc_lens=doc_lens)
    assert torch.allclose(h, expected, rtol=0, atol=1e-6)
    # the document mask reaches the stages: without it the logits differ
    h = tokens
    for module in modules:
        h = module(h)
    assert not torch.allclose(h, expected, atol=1e-3)


def test_full_block_checkpointing_gives_the_same_gradients(model):
    tokens = torch.randint(0, 256, (2, 17))
    block_args = llama_block_args(model.config)
    grads = []
    for recompute in (False, True):
        (stage,) = stage_modules(
            model, split_layers(4, 1), [0], block_args=block_args, checkpoint_blocks=recompute
        )
        cross_entropy_loss(stage(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append({n: p.grad.clone() for n, p in stage.named_parameters()})
        model.zero_grad()
    for name, grad in grads[0].items():
        assert torch.allclose(grads[1][name], grad, rtol=1e-6, atol=1e-7), name


def test_tied_embeddings_on_two_stages_are_refused():
    tied = Llama(small_config(tie_embeddings=True))
    with pytest.raises(ParallelConfigError, match="shared by stages 0 and 1"):
        stage_modules(tied, split_layers(4, 2), [0])
    stage_modules(tied, split_layers(4, 1), [0])  # one stage holds both: fine


def test_models_outside_the_contract_are_refused(model):
    with pytest.raises(ParallelConfigError, match="has no module 'blocks'"):
        stage_modules(model, split_layers(4, 2), [0], layers="blocks")
    with pytest.raises(ParallelConfigError, match=r"covers 6 blocks but Llama\.layers holds 4"):
        stage_modules(model, split_layers(6, 2), [0])
    with pytest.raises(ParallelConfigError, match=r"\['norm.weight'\] of Llama belong to no"):
        stage_modules(model, split_layers(4, 2), [0], post=("lm_head",))
    with pytest.raises(ParallelConfigError, match="computes sequence-first"):
        stage_modules(Llama(small_config(sequence_first=True)), split_layers(4, 2), [0])

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(2, 2))

    with pytest.raises(ParallelConfigError, match=r"is a Sequential, not an nn\.ModuleList"):
        stage_modules(Flat(), split_layers(1, 1), [0], pre=(), post=())


# ---- PP2 and PP2 x TP2 on spawned gloo processes ---------------------------------------------


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    torch.manual_seed(1)
    config = small_config()
    model = Llama(config)
    data = {
        "config": config.to_dict(),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "tokens": torch.randint(0, config.vocab_size, (4, 17)),
        "doc_lens": torch.tensor([[16, 0], [5, 11], [10, 6], [3, 13]]),
        "schedules": RUNS,
        "n_microbatches": N_MICRO,
        "lr": LR,
        "steps": STEPS,
    }
    return {"data": data, "workdir": tmp_path_factory.mktemp("pipeline")}


@pytest.fixture(scope="module")
def reference(case) -> dict:
    data = case["data"]
    model = Llama(LlamaConfig(**data["config"]))
    model.load_state_dict(data["state"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tokens, out = data["tokens"], {"losses": []}
    for step in range(STEPS):
        loss = cross_entropy_loss(model(tokens[:, :-1], doc_lens=data["doc_lens"]), tokens[:, 1:])
        loss.backward()
        out["losses"].append(loss.detach())
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def launch(case: dict, layout: str) -> list[list[dict]]:
    """Run every schedule on ``pp x tp`` spawned processes (one job for all of them); per
    schedule (in RUNS order), each pipeline rank's results, TP peers in TP order."""
    tp, n_micro = LAYOUTS[layout]
    world = 2 * tp
    workdir = case["workdir"] / layout
    workdir.mkdir()
    torch.save({**case["data"], "n_microbatches": n_micro, "tp": tp}, workdir / "input.pt")
    run_ranks(WORKER, [str(workdir)], world)
    out = []
    for name, _ in RUNS:
        ranks = [
            torch.load(workdir / f"{name}-rank{r}.pt", weights_only=False) for r in range(world)
        ]
        assert [(r["pp_rank"], r["tp_rank"]) for r in ranks] == [
            (r // tp, r % tp) for r in range(world)
        ], "tp is not the innermost mesh dimension"
        out.append([ranks[p * tp : (p + 1) * tp] for p in range(2)])
    return out


@pytest.fixture(scope="module")
def pipelines(case) -> dict:
    """Lazily launched layouts: ``pipelines(layout)[schedule]`` is a list over pipeline ranks
    of the TP peers' results."""
    done: dict = {}

    def get(layout: str) -> dict:
        if layout not in done:
            done[layout] = dict(zip([n for n, _ in RUNS], launch(case, layout), strict=True))
        return done[layout]

    return get


@pytest.fixture(params=[(lay, name) for lay in LAYOUTS for name, _ in RUNS], ids="-".join)
def run(request, pipelines) -> tuple[str, list[list[dict]]]:
    layout, name = request.param
    return f"{layout} {name}", pipelines(layout)[name]


def merged(pp_ranks: list[list[dict]], key: str) -> dict:
    """``key`` of the whole pipeline, from TP rank 0 of each pipeline rank (whole tensors)."""
    out: dict = {}
    for peers in pp_ranks:
        rank = peers[0]
        assert not set(out) & set(rank[key]), "a parameter on two pipeline ranks"
        for peer in peers[1:]:  # the TP peers gathered the same whole tensors
            assert sorted(peer[key]) == sorted(rank[key])
            for n, t in rank[key].items():
                assert torch.equal(peer[key][n], t), f"TP peers disagree on {key} {n}"
        out.update(rank[key])
    return out


def test_every_offered_schedule_is_tested():
    assert sorted(name for name, _ in RUNS) == sorted(SCHEDULES)


@needs_pipeline_torch
def test_pipeline_losses_match_single_process(run, reference):
    name, pp_ranks = run
    (peers,) = [p for p in pp_ranks if p[0]["losses"]]  # only the last stage's ranks
    for rank in peers:
        losses = rank["losses"]
        assert len(losses) == STEPS
        for step, (loss, expected) in enumerate(zip(losses, reference["losses"], strict=True)):
            error = relative_error(loss, expected)
            assert error < TOL, f"{name} step {step}: loss off by {error:.2e}"


@needs_pipeline_torch
def test_pipeline_gradients_match_single_process(run, reference):
    name, pp_ranks = run
    grads = merged(pp_ranks, "grads")
    assert sorted(grads) == sorted(reference["grads"])
    for param, expected in reference["grads"].items():
        error = relative_error(grads[param], expected)
        assert error < TOL, f"{name}: grad of {param} off by {error:.2e}"


@needs_pipeline_torch
def test_pipeline_parameters_after_sgd_steps_match_single_process(run, reference, case):
    name, pp_ranks = run
    params, initial = merged(pp_ranks, "params"), case["data"]["state"]
    for param, expected in reference["params"].items():
        # the update, not the parameter: it is what the pipeline computed
        error = relative_error(params[param] - initial[param], expected - initial[param])
        assert error < TOL, f"{name}: update of {param} off by {error:.2e}"


@needs_pipeline_torch
def test_pipeline_stage_state_dicts_form_the_model_checkpoint(run, case):
    name, pp_ranks = run
    keys = [k for peers in pp_ranks for k in peers[0]["state_keys"]]
    assert sorted(keys) == sorted(case["data"]["state"]), name
    fresh = Llama(LlamaConfig(**case["data"]["config"]))
    fresh.load_state_dict(merged(pp_ranks, "params"), strict=True)


@needs_pipeline_torch
def test_pipeline_stages_are_split_over_tp(run, case):
    name, pp_ranks = run
    norms = {n for n in case["data"]["state"] if "norm" in n}
    expected = sorted(set(case["data"]["state"]) - norms) if len(pp_ranks[0]) > 1 else []
    assert sorted(n for peers in pp_ranks for n in peers[0]["sharded"]) == expected, name


@needs_pipeline_torch
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_splits_follow_the_request(pipelines, layout):
    expected = {
        "1F1B": [[0, 1], [2, 3]],
        "GPipe": [[0], [1, 2, 3]],
        "Interleaved1F1B": [[], [0], [1, 2], [3]],
        "InterleavedZeroBubble": [[0], [1], [2], [3]],
        "ZBVZeroBubble": [[], [0], [1, 2], [3]],
    }
    for name, pp_ranks in pipelines(layout).items():
        assert [list(s.layers) for s in pp_ranks[0][0]["splits"]] == expected[name], name


@needs_pipeline_torch
def test_a_step_on_a_batch_the_micro_batches_do_not_divide_is_refused_on_every_rank(
    pipelines, case
):
    pipelines("pp2")  # its job ends with a 1F1B step on 6 rows in 4 micro-batches
    for rank in range(2):  # the first stage's rank is passed ids, the last's the target
        refused = torch.load(case["workdir"] / "pp2" / f"uneven-rank{rank}.pt")["refused"]
        assert "splits each batch into n_microbatches=4 equal micro-batches" in refused, rank
        assert "has 6 rows" in refused, rank


@needs_pipeline_torch
def test_stages_run_on_the_device_of_the_pipeline_mesh_unless_told(tmp_path):
    # one spawned rank; a "cuda" mesh is built on gloo without a GPU, and nothing runs
    run_ranks(WORKER, [str(tmp_path), "devices"], 1)
    found = torch.load(tmp_path / "devices-rank0.pt")
    assert found == {
        "cpu mesh": "cpu",
        "cuda mesh": "cuda",
        "cuda mesh, device='cpu'": "cpu",
        "process group": "cpu",
    }


@pytest.mark.oldtorch
@pytest.mark.skipif(not OLD_TORCH, reason="runs on a torch older than the pipeline needs")
def test_an_older_torch_is_refused_before_any_communication(tmp_path):
    # refused before the process group is needed: none is initialised here
    with pytest.raises(ParallelConfigError, match="needs torch>="):
        build_pipeline(
            Llama(small_config()), schedule="1F1B", n_microbatches=2, loss_fn=cross_entropy_loss
        )
