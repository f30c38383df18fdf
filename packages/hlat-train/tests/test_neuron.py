"""The Trainium backend of the trainer as pure logic: the recipe's environment, the
precision it describes, the arguments of NxD's ZeRO-1 and of the checkpointer (running it
needs a trn1)."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from hlat_parallel import ParallelConfigError, ParallelDims
from hlat_train.config import NeuronConfig, TrainConfig
from hlat_train.neuron import (
    DEPRECATED_BF16_SWITCHES,
    LLM_TRAINING_FLAG,
    STOCHASTIC_ROUNDING,
    apply_neuron_env,
    describe_precision,
    extracting_graphs,
    mark_step,
    neuron_checkpointer_kwargs,
    neuron_env,
    neuron_grad_norm,
    neuron_optimizer,
    neuron_optimizer_kwargs,
    neuron_step,
)


def test_recipe_environment_for_bf16_with_stochastic_rounding():
    env = neuron_env(NeuronConfig(), "bf16-sr")
    assert env["NEURON_CC_FLAGS"] == "--model-type transformer " + LLM_TRAINING_FLAG
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    assert env["NEURON_FUSE_SOFTMAX"] == "1"
    assert env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "3"
    assert env["MALLOC_ARENA_MAX"] == "64"
    assert "FI_PROVIDER" not in env  # single node


def test_llm_training_strategy_is_switchable_and_never_duplicated():
    config = NeuronConfig(
        llm_training_strategy=False, cc_flags=f"--model-type transformer {LLM_TRAINING_FLAG}"
    )
    assert LLM_TRAINING_FLAG not in neuron_env(config)["NEURON_CC_FLAGS"]
    config.llm_training_strategy = True
    assert neuron_env(config)["NEURON_CC_FLAGS"].count(LLM_TRAINING_FLAG) == 1


def test_multi_node_sets_efa_and_cache_dir_reaches_the_compiler():
    env = neuron_env(NeuronConfig(cache_dir="/local/neuron-cache"), "mixed", multi_node=True)
    assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"], env["FI_EFA_FORK_SAFE"]) == (
        "efa",
        "1",
        "1",
    )
    assert "--cache_dir=/local/neuron-cache" in env["NEURON_CC_FLAGS"]
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "0"  # mixed precision keeps fp32 masters


def test_variables_the_user_set_win(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    monkeypatch.delenv("NEURON_FUSE_SOFTMAX", raising=False)
    applied = apply_neuron_env(TrainConfig.preset("llama2-7b-trn1-128").neuron, "bf16-sr", True)
    assert os.environ["MALLOC_ARENA_MAX"] == "8" and "MALLOC_ARENA_MAX" not in applied
    assert os.environ["NEURON_FUSE_SOFTMAX"] == "1"
    for key in applied:
        monkeypatch.delenv(key)


def test_mark_step_is_a_no_op_off_xla():
    assert mark_step() is None


def test_graph_extraction_is_told_by_the_variable_neuron_parallel_compile_sets(monkeypatch):
    # as NxD's training scripts read it: set to anything non-empty
    assert extracting_graphs({"NEURON_EXTRACT_GRAPHS_ONLY": "1"})
    assert not extracting_graphs({"NEURON_EXTRACT_GRAPHS_ONLY": ""})
    assert not extracting_graphs({})
    monkeypatch.setenv("NEURON_EXTRACT_GRAPHS_ONLY", "1")
    assert extracting_graphs()
    monkeypatch.delenv("NEURON_EXTRACT_GRAPHS_ONLY")
    assert not extracting_graphs()


# --- the pieces a training loop on NxD calls ------------------------------------------------

PRECISION_MODES = ["bf16-sr", "bf16", "mixed", "fp32"]


def neuron_dims(tp: int = 2, dp: int = 4) -> ParallelDims:
    return ParallelDims(
        world_size=tp * dp, rank=0, tp=tp, dp=dp, sp=True, backend="neuron",
        device=torch.device("cpu"), tp_rank=0, dp_rank=0,
    )  # fmt: skip


@pytest.mark.parametrize("precision", PRECISION_MODES)
def test_the_environment_set_for_a_precision_is_the_one_it_describes(precision):
    env = neuron_env(NeuronConfig(), precision)
    line = describe_precision(precision, env)
    assert line.startswith(f"{precision}: ") and "\n" not in line


def test_bf16_sr_is_described_as_hlat_ran_it():
    line = describe_precision("bf16-sr", {STOCHASTIC_ROUNDING: "1"})
    assert "bf16 weights, gradients and AdamW moments" in line
    assert "optimizer_dtype bfloat16" in line and "no fp32 master copy" in line
    assert "NEURON_RT_STOCHASTIC_ROUNDING_EN=1" in line


def test_a_rounding_switch_that_contradicts_the_precision_is_refused():
    with pytest.raises(
        ValueError,
        match=r"bf16-sr needs NEURON_RT_STOCHASTIC_ROUNDING_EN=1, but it is '0'.*\(bf16\)",
    ):
        describe_precision("bf16-sr", {STOCHASTIC_ROUNDING: "0"})
    with pytest.raises(
        ValueError,
        match=r"mixed needs NEURON_RT_STOCHASTIC_ROUNDING_EN=0, but it is '1'.*\(bf16-sr\)",
    ):
        describe_precision("mixed", {STOCHASTIC_ROUNDING: "1"})
    with pytest.raises(ValueError, match="it is not set; call apply_neuron_env"):
        describe_precision("bf16", {})


@pytest.mark.parametrize("switch", DEPRECATED_BF16_SWITCHES)
def test_the_deprecated_bf16_switches_are_refused(switch):
    with pytest.raises(ValueError, match=rf"{switch}=1 stores fp32 tensors as bf16"):
        describe_precision("mixed", {STOCHASTIC_ROUNDING: "0", switch: "1"})


def test_bf16_kahan_is_refused_before_any_environment_is_set():
    with pytest.raises(ParallelConfigError, match="bf16-kahan is not available on the neuron"):
        neuron_env(NeuronConfig(), "bf16-kahan")


def test_zero1_gets_adamw_the_precisions_dtypes_and_the_configured_clip():
    config = TrainConfig.preset("hlat-7b")
    assert config.optim.precision == "bf16-sr"
    config.optim.clip = 0.7
    assert neuron_optimizer_kwargs(config) == {
        "lr": config.optim.lr,
        "betas": (0.9, 0.95),
        "eps": config.optim.eps,
        "weight_decay": 0.1,
        "optimizer_dtype": torch.bfloat16,
        "use_grad_acc_hook": False,
        "higher_cc_precision": False,
        "save_master_weights": False,
        "grad_clipping": True,
        "max_norm": 0.7,
    }
    config.optim.precision, config.optim.clip = "mixed", 0.0
    kwargs = neuron_optimizer_kwargs(config)
    assert kwargs["optimizer_dtype"] == torch.float32 and kwargs["use_grad_acc_hook"]
    assert kwargs["save_master_weights"] and kwargs["max_norm"] == math.inf


def test_the_optimizer_refuses_weights_of_another_dtype_or_another_backend():
    config = TrainConfig.preset("hlat-7b")  # bf16-sr
    model = torch.nn.Linear(4, 4)  # fp32
    with pytest.raises(
        ValueError,
        match=r"bf16-sr trains torch\.bfloat16 weights, but the model has torch\.float32",
    ):
        neuron_optimizer(config, model, neuron_dims())
    torch_dims = dataclasses.replace(neuron_dims(), backend="torch")
    with pytest.raises(ValueError, match="needs dims of the neuron backend"):
        neuron_optimizer(config, model.to(torch.bfloat16), torch_dims)


def test_the_checkpointer_follows_the_checkpoint_section():
    config = TrainConfig.preset("hlat-7b")
    config.checkpoint.keep_last, config.checkpoint.async_save = 3, False
    assert neuron_checkpointer_kwargs(config, neuron_dims()) == {
        "root_url": config.checkpoint_dir,
        "keep_last": 3,
        "async_save": False,
        "verify_checksums": True,
        "layout": {"tp": 2, "dp": 4, "sp": True},
    }


def test_grad_norm_comes_only_from_zero1():
    with pytest.raises(TypeError, match="has no grad_norm"):
        neuron_grad_norm(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))


@pytest.mark.parametrize("policy", ["off", "warn", "skip", "rollback"])
def test_a_non_finite_loss_never_reaches_zero1_whatever_the_policy(policy):
    from types import SimpleNamespace

    from hlat_train import SpikeGuard, Trainer

    class Zero1Like(torch.optim.AdamW):
        """What the trainer reads of NxD's ZeRO-1 besides ``step``: its ``grad_norm``."""

        steps = 0

        def step(self, closure=None):
            self.steps += 1
            return super().step(closure)

        @property
        def grad_norm(self) -> torch.Tensor:  # the norm computed by the last step()
            return torch.tensor(float(self.steps))

    config = TrainConfig.preset("hlat-7b")
    config.spike.policy = policy
    weight = torch.nn.Parameter(torch.ones(3))
    # the trainer's own step on the neuron path (building one needs a trn1)
    trainer = Trainer.__new__(Trainer)
    trainer.config, trainer.dims, trainer._extracting = config, neuron_dims(), False
    guard = SpikeGuard(window=4, k=3.0, min_history=2) if policy != "off" else None
    trainer.state = SimpleNamespace(guard=guard)  # type: ignore[assignment]
    trainer.optimizer = Zero1Like([weight], lr=0.1)
    for loss, stepped in ((math.nan, False), (math.inf, False), (2.0, True)):
        weight.grad = torch.full((3,), loss)
        norm, spike, skip = trainer._update(torch.tensor(loss))
        assert bool(skip) is not stepped and bool(spike) is not stepped
        # a skipped step logs no norm: not the one ZeRO-1 kept from an earlier step
        assert math.isnan(norm) if not stepped else float(norm) == trainer.optimizer.steps
        assert torch.equal(weight.detach(), torch.ones(3)) is not stepped, (policy, loss)


def test_while_graphs_are_collected_the_step_always_runs():
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    assert neuron_step(optimizer, torch.tensor(True), extracting=True) is False
    assert not torch.equal(weight.detach(), torch.ones(3))
