"""Context parallelism: the load-balanced sequence layout and attention over all-gathered K/V.

The layout, its inverse and the checks are pure. Two spawned gloo processes
(tests/context_worker.py) run a 2-layer GQA Llama (fp32) on their halves of a batch, without
and with selective activation checkpointing; each rank's logits and the gradients summed
over the cp group equal the single-process model's within 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawn import run_ranks
from torch import nn

from hlat_model import Llama, LlamaConfig, cross_entropy_loss
from hlat_parallel import (
    ParallelConfigError,
    apply_context_parallel,
    check_context_parallel,
    cp_indices,
    shard_sequence,
    unshard_sequence,
)

WORKER = Path(__file__).with_name("context_worker.py")
CP, TOL = 2, 1e-5
MODES = ["none", "selective"]  # activation checkpointing of the model

# ---- the layout, pure -------------------------------------------------------------------------


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert cp_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_indices(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert cp_indices(7, 1, 0).tolist() == list(range(7))  # cp 1: any length


@pytest.mark.parametrize(("seq_len", "cp"), [(8, 1), (8, 2), (16, 4), (24, 3), (64, 8)])
def test_every_position_is_held_by_exactly_one_rank(seq_len, cp):
    held = torch.cat([cp_indices(seq_len, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq_len))


@pytest.mark.parametrize(("seq_len", "cp"), [(8, 2), (16, 4), (24, 3), (64, 8)])
def test_every_rank_has_the_same_causal_work(seq_len, cp):
    # a query at position p attends to p + 1 keys
    work = [(cp_indices(seq_len, cp, r) + 1).sum().item() for r in range(cp)]
    assert work == [seq_len * (seq_len + 1) // 2 // cp] * cp


def test_shards_of_every_rank_unshard_to_the_sequence():
    t = torch.arange(2 * 12 * 3).reshape(2, 12, 3)
    shards = [shard_sequence(t, 3, r) for r in range(3)]
    assert shards[0].shape == (2, 4, 3)
    assert torch.equal(shards[2][:, :, 0], t[:, [4, 5, 6, 7], 0])
    assert torch.equal(unshard_sequence(shards), t)
    t = t.flatten(0, 1)  # 24 tokens along dim 0
    assert torch.equal(unshard_sequence([shard_sequence(t, 2, r, dim=0) for r in range(2)], 0), t)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 16), "cp must be a positive integer, got 0"),
        ((True, 16), "cp must be a positive integer, got True"),
        ((2, 0), "seq_len must be a positive integer, got 0"),
        ((2, 10), r"2 \* cp = 4 equal chunks, but seq_len 10 .* \(e\.g\. 8 or 12\)"),
        ((4, 6), r"seq_len 6 is not divisible by 8; use a multiple of 8 \(e\.g\. 8\)"),
        ((2, 16, True), "document masking .* not supported yet; set data.document_mask=false"),
    ],
)
def test_layouts_that_cannot_work_are_refused_with_the_reason(args, message):
    with pytest.raises(ParallelConfigError, match=message):
        check_context_parallel(*args)


def test_document_masking_without_context_parallelism_is_allowed():
    check_context_parallel(1, 15, document_mask=True)


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ParallelConfigError, match=r"cp_rank 2 is outside 0\.\.1"):
        cp_indices(8, 2, 2)


def test_a_model_without_a_swappable_attention_function_is_refused():
    with pytest.raises(ParallelConfigError, match="Sequential has no module with an `attend`"):
        apply_context_parallel(nn.Sequential(nn.Linear(2, 2)))


# ---- CP2 on spawned gloo processes -------------------------------------------------------------


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def small_config(**overrides) -> LlamaConfig:
    fields = dict(n_layers=2, vocab_size=256, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    return LlamaConfig.preset("tiny", max_seq_len=64, **{**fields, **overrides})


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    torch.manual_seed(2)
    model = Llama(small_config())
    data = {
        "configs": {mode: small_config(checkpointing=mode).to_dict() for mode in MODES},
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "tokens": torch.randint(0, 256, (2, 17)),
    }
    workdir = tmp_path_factory.mktemp("cp2")
    torch.save(data, workdir / "input.pt")
    return {"data": data, "workdir": workdir}


@pytest.fixture(scope="module")
def reference(case) -> dict:
    data = case["data"]
    model = Llama(small_config())
    model.load_state_dict(data["state"])
    tokens = data["tokens"]
    logits = model(tokens[:, :-1])
    loss = cross_entropy_loss(logits, tokens[:, 1:])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads}


@pytest.fixture(scope="module")
def cp2(case) -> dict:
    workdir = case["workdir"]
    run_ranks(WORKER, [str(workdir)], CP)
    return {
        mode: [torch.load(workdir / f"{mode}-rank{r}.pt", weights_only=False) for r in range(CP)]
        for mode in MODES
    }


@pytest.mark.parametrize("mode", MODES)
def test_cp2_logits_of_each_shard_match_single_process(cp2, reference, mode):
    for rank, result in enumerate(cp2[mode]):
        expected = reference["logits"][:, cp_indices(16, CP, rank)]
        error = relative_error(result["logits"], expected)
        assert error < TOL, f"{mode} rank {rank}: logits off by {error:.2e}"
    whole = unshard_sequence([r["logits"] for r in cp2[mode]])
    assert relative_error(whole, reference["logits"]) < TOL


@pytest.mark.parametrize("mode", MODES)
def test_cp2_mean_of_rank_losses_is_the_single_process_loss(cp2, reference, mode):
    loss = torch.stack([r["loss"] for r in cp2[mode]]).mean()
    assert relative_error(loss, reference["loss"]) < TOL


@pytest.mark.parametrize("mode", MODES)
def test_cp2_gradients_summed_over_cp_match_single_process(cp2, reference, mode):
    for rank, result in enumerate(cp2[mode]):
        assert sorted(result["grads"]) == sorted(reference["grads"])
        for name, expected in reference["grads"].items():
            error = relative_error(result["grads"][name], expected)
            assert error < TOL, f"{mode} rank {rank}: grad of {name} off by {error:.2e}"


def test_cp2_document_masking_is_refused(cp2):
    for result in cp2["none"]:
        message = result.get("document_mask_error", "")
        assert "backend 'sdpa' (document masking), which is not supported yet" in message


def test_cp2_applying_context_parallelism_twice_is_refused(cp2):
    for result in cp2["none"]:
        assert "already applied to Llama (2 attention modules)" in result.get("twice_error", "")
