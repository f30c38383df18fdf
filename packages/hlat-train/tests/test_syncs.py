"""A training step reads nothing from the device; logged steps read a few values once."""

from __future__ import annotations

import itertools

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode
from train_helpers import tiny_config

from hlat_train import Trainer

_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


class HostReads(TorchDispatchMode):
    """Counts what makes the host wait for the device: scalar reads
    (``aten._local_scalar_dense``: ``.item()``, ``float(t)``, ``bool(t)``) and copies from
    an accelerator to the CPU (none exist on a CPU-only run)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        elif func in _COPIES and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if isinstance(source, torch.Tensor) and source.device.type != "cpu":
                self.reads += 1
        return out


def _reads_per_step(corpus, out, *extra: str) -> list[int]:
    """Host reads between the ends of consecutive optimizer steps of a 20-step run logged
    every 10 steps; entry i covers step i + 2 and the logging of step i + 1."""
    config = tiny_config(
        corpus,
        out,
        "--logging.every=10",
        "--checkpoint.every=100",
        "--data.valid_paths=[]",
        "--optim.impl=auto",
        "--optim.precision=bf16-sr",
        "--spike.policy=skip",
        *extra,
        steps=20,
    )
    trainer = Trainer(config)
    mode = HostReads()
    marks: list[int] = []
    hook = register_optimizer_step_post_hook(lambda *_: marks.append(mode.reads))
    try:
        with mode:
            trainer.fit()
    finally:
        hook.remove()
        trainer.close()
    return [b - a for a, b in itertools.pairwise(marks)]


def test_only_logged_steps_read_the_device_and_never_per_parameter(corpus, tmp_path):
    small = _reads_per_step(corpus, tmp_path / "small")
    large = _reads_per_step(corpus, tmp_path / "large", "--model.n_layers=6")
    assert len(small) == 19
    # The logged step's reads fall before its optimizer step (entry 8) or after it, with
    # the logging of step 10 (entry 9): on an accelerator the one copy of the logged values
    # to the host comes after the step.
    logged = {10 - 2, 10 - 1}
    assert sum(small[i] for i in logged) <= 4, f"step 10 (logged) read the device {small[8:10]}"
    for i, reads in enumerate(small):
        if i not in logged:
            assert reads == 0, f"step {i + 2} (not logged) read the device {reads} times"
    assert large == small  # 3x the parameters, the same reads
