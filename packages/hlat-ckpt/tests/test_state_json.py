import math

import numpy as np
import pytest
import torch

from hlat_ckpt import state_json


def roundtrip(tree):
    skeleton, tensors = state_json.split(tree, "entry")
    return state_json.join(state_json.loads(state_json.dumps(skeleton)), tensors)


def test_nested_state_with_tuples_int_keys_numpy_and_bytes_survives_json():
    tree = {
        "pos": 3,
        "by_rank": {0: [1, 2], 1: (3, None)},
        "rng": ("MT19937", np.arange(5, dtype=np.uint32), 2, 0, 0.5),
        "scalar": np.float32(1.5),
        "raw": b"\x00\xff",
        "flags": [True, False],
    }
    back = roundtrip(tree)
    assert back["by_rank"] == {0: [1, 2], 1: (3, None)}
    assert back["rng"][0] == "MT19937" and back["rng"][1].dtype == np.uint32
    np.testing.assert_array_equal(back["rng"][1], np.arange(5))
    assert isinstance(back["scalar"], np.float32) and back["scalar"] == 1.5
    assert back["raw"] == b"\x00\xff" and back["flags"] == [True, False]


def test_non_finite_floats_are_kept_in_strict_json():
    back = roundtrip({"a": float("nan"), "b": float("inf"), "c": -float("inf")})
    assert math.isnan(back["a"]) and back["b"] == math.inf and back["c"] == -math.inf


def test_tensors_are_taken_out_of_the_json_under_path_keys():
    t = torch.arange(4.0)
    skeleton, tensors = state_json.split({"state": {0: {"exp_avg": t}}, "w/x": t}, "optim")
    assert set(tensors) == {"optim/state/int:0/exp_avg", "optim/w%2Fx"}
    assert tensors["optim/state/int:0/exp_avg"] is t
    assert b"exp_avg" in state_json.dumps(skeleton) and b"0.0" not in state_json.dumps(skeleton)
    assert sorted(state_json.tensor_refs(skeleton)) == sorted(tensors)


def test_arbitrary_objects_are_refused_with_their_path():
    with pytest.raises(TypeError, match=r"loader\['workers'\]\[1\].*cannot save a .*object"):
        state_json.split({"workers": [1, object()]}, "loader")


def test_a_missing_tensor_on_join_names_its_key():
    skeleton, _ = state_json.split({"w": torch.zeros(2)}, "model")
    with pytest.raises(KeyError, match="model/w"):
        state_json.join(skeleton, {})
