"""Python, NumPy and torch random-number-generator state as a checkpointable object."""

from __future__ import annotations

import random
from array import array
from typing import Any

import torch


class RNGState:
    """The calling process's RNG states (``random``, NumPy's global generator if NumPy is
    installed, torch's CPU generator and the generator of every device of the accelerator
    ``torch.accelerator`` reports, CUDA or another), with
    ``state_dict()/load_state_dict()``.

    :class:`~hlat_ckpt.Checkpointer` saves one per rank under the name ``"rng"`` unless told
    not to, so that a resumed run draws the same random numbers (dropout, sampling,
    stochastic rounding) as an uninterrupted one.
    """

    def state_dict(self) -> dict[str, Any]:
        """The current generator states."""
        version, internal, gauss = random.getstate()
        # Note: the Mersenne Twister's 625 words as bytes, not a list: one JSON value to
        # encode instead of 625, which is most of the time a small save blocks for.
        state: dict[str, Any] = {
            "python_mt": {"version": version, "words": array("I", internal).tobytes()},
            "python_gauss": gauss,
            "torch": torch.get_rng_state(),
        }
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            state["numpy"] = np.random.get_state()
        found = _accelerator_module()
        if found is not None and getattr(found[1], "is_initialized", lambda: True)():
            # keyed by device type ("cuda", "neuron"...), as hlat-ckpt 0.2 keyed CUDA's
            state[found[0]] = _device_states(found[1])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the generator states in ``state`` (those absent are left as they are)."""
        if "python_mt" in state:
            words = array("I")
            words.frombytes(state["python_mt"]["words"])
            random.setstate((state["python_mt"]["version"], tuple(words), state["python_gauss"]))
        elif "python" in state:  # the layout of hlat-ckpt 0.1
            version, internal, gauss = state["python"]
            random.setstate((version, tuple(internal), gauss))
        if "torch" in state:
            torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
        found = _accelerator_module()
        if found is not None and found[0] in state:
            _set_device_states(found[1], list(state[found[0]]))


def _accelerator_module() -> tuple[str, Any] | None:
    """(device type, torch module) of the accelerator (``torch.cuda``, ``torch.xpu``,
    TorchNeuron's...) when there is one and it keeps per-device generator states, every
    device's at once (``get_rng_state_all``) or one device's (``get_rng_state(device)``),
    else None."""
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if device is None:
        return None
    module = torch.get_device_module(device)
    if not (
        callable(getattr(module, "get_rng_state_all", None))
        or callable(getattr(module, "get_rng_state", None))
    ):
        return None
    return device.type, module


def _device_states(module: Any) -> list[torch.Tensor]:
    """Every visible device's generator state, in device order."""
    if callable(getattr(module, "get_rng_state_all", None)):
        return list(module.get_rng_state_all())
    return [module.get_rng_state(index) for index in range(torch.accelerator.device_count())]


def _set_device_states(module: Any, states: list[torch.Tensor]) -> None:
    """Restore :func:`_device_states`'s list; devices beyond it keep theirs."""
    if callable(getattr(module, "set_rng_state_all", None)):
        module.set_rng_state_all(states)
        return
    for index, device_state in enumerate(states[: torch.accelerator.device_count()]):
        module.set_rng_state(device_state, index)
