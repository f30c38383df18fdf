"""The NxD backend's argument mapping (the NxD calls themselves need a trn1 to verify)."""

import random

import pytest
import torch

from hlat_ckpt.neuron import (
    NeuronCheckpointer,
    apply_user_content,
    load_checkpoint_kwargs,
    save_checkpoint_kwargs,
)


def training_state():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": {"pos": 7}}


def test_save_maps_model_optimizer_scheduler_and_puts_the_rest_in_user_content():
    state = training_state()
    kwargs = save_checkpoint_kwargs("s3://b/run", 1000, state, keep_last=5, async_save=True)
    assert kwargs["checkpoint_dir_str"] == "s3://b/run"
    assert kwargs["tag"] == "step_0000001000"
    assert kwargs["model"] is state["model"] and kwargs["optimizer"] is state["optimizer"]
    assert kwargs["scheduler"] is state["scheduler"]
    assert (kwargs["num_kept_ckpts"], kwargs["async_save"], kwargs["use_xser"]) == (5, True, True)
    content = kwargs["user_content"]
    assert content["hlat_step"] == 1000 and content["loader"] == {"pos": 7}
    assert set(content["rng"]) >= {"python_mt", "torch"}


def test_load_maps_latest_to_no_tag_and_a_step_to_its_tag():
    state = training_state()
    assert load_checkpoint_kwargs("/ckpt", None, state)["tag"] is None
    kwargs = load_checkpoint_kwargs("/ckpt", 20, state, num_workers=4)
    assert (kwargs["path"], kwargs["tag"], kwargs["num_workers"]) == ("/ckpt", "step_0000000020", 4)
    assert kwargs["model"] is state["model"]


def test_user_content_restores_entries_and_rng_and_returns_the_step():
    state = training_state()
    content = save_checkpoint_kwargs("/ckpt", 30, state)["user_content"]
    expected = random.random()
    state["loader"]["pos"] = 0
    random.random()
    assert apply_user_content(content, state) == 30
    assert state["loader"] == {"pos": 7} and random.random() == expected


def test_two_models_are_refused():
    state = training_state() | {"ema": torch.nn.Linear(4, 4)}
    with pytest.raises(ValueError, match=r"exactly one nn\.Module"):
        save_checkpoint_kwargs("/ckpt", 1, state)


def test_without_the_neuron_sdk_the_checkpointer_says_what_to_install(tmp_path):
    try:
        import neuronx_distributed  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("the Neuron SDK is installed")
    with pytest.raises(RuntimeError, match="Neuron package repository"):
        NeuronCheckpointer(tmp_path)
