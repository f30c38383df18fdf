"""Device generator states of an accelerator whose torch module keeps them per device only.

The accelerator is a Python backend registered under TorchNeuron's device name in a fresh
process: its module has ``get_rng_state(device)`` and ``set_rng_state(state, device)`` but
no ``*_all`` forms. The states go through a real checkpoint (DCP files, the manifest)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend


class DeviceModule:
    states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 2

    @staticmethod
    def current_device():
        return 0

    @classmethod
    def get_rng_state(cls, device=0):
        return cls.states[int(device)].clone()

    @classmethod
    def set_rng_state(cls, state, device=0):
        cls.states[int(device)] = state.clone()


_setup_privateuseone_for_python_backend("neuron", backend_module=DeviceModule())

from hlat_ckpt import Checkpointer

model = torch.nn.Linear(2, 2)
ckpt = Checkpointer(sys.argv[1], async_save=False)
ckpt.save(1, {"model": model})
saved = [s.tolist() for s in DeviceModule.states]
DeviceModule.states = [torch.tensor([9, 9], dtype=torch.uint8)] * 2
assert ckpt.load_latest({"model": model}) == 1
ckpt.close()
print(saved, [s.tolist() for s in DeviceModule.states])
"""


def test_device_states_kept_per_device_round_trip_through_a_checkpoint(tmp_path):
    from torch.utils import backend_registration

    if not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"):
        pytest.skip("this torch cannot register a Python device backend")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[[1, 2], [3, 4]] [[1, 2], [3, 4]]"
