"""The Trainium environment of the recipe, as pure logic (running it needs a trn1)."""

from __future__ import annotations

import os

from hlat_train.config import NeuronConfig, TrainConfig
from hlat_train.neuron import LLM_TRAINING_FLAG, apply_neuron_env, mark_step, neuron_env


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
