"""The Trainium environment of the HLAT recipe, and XLA step marking.

:func:`neuron_env` is pure (config in, variables out) and tested anywhere;
:func:`apply_neuron_env` sets them in ``os.environ`` before ``torch_xla`` is imported.
Running on Trainium needs a trn1 instance with the Neuron SDK to verify.

Pre-compiling: run the same command under ``neuron_parallel_compile`` with a few steps
(``neuron_parallel_compile torchrun --nproc-per-node 32 -m hlat_train train --config
hlat-7b --train.steps=10``); it traces every graph and compiles them in parallel into the
compile cache (``neuron.cache_dir``, passed as ``--cache_dir`` in ``NEURON_CC_FLAGS``;
default ``/var/tmp/neuron-compile-cache``). On a cluster, compile once into shared storage,
then copy the cache to each node's local disk and point ``neuron.cache_dir`` there: HLAT
found shared storage too slow to serve the cache to every node.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from hlat_train.config import NeuronConfig

LLM_TRAINING_FLAG = "--distribution-strategy=llm-training"


def neuron_env(
    config: NeuronConfig, precision: str = "bf16-sr", multi_node: bool = False
) -> dict[str, str]:
    """The environment variables of the recipe for ``config``.

    ``precision`` maps to the hardware switches: ``bf16-sr`` sets
    ``NEURON_RT_STOCHASTIC_ROUNDING_EN=1`` (the model is cast to bf16 by the trainer);
    ``bf16`` turns stochastic rounding off; ``mixed`` and ``fp32`` leave it off and keep fp32
    master weights in the optimizer. EFA variables are set for multi-node runs.
    """
    flags = shlex.split(config.cc_flags)
    flags = [f for f in flags if f != LLM_TRAINING_FLAG]
    if config.llm_training_strategy:
        flags.append(LLM_TRAINING_FLAG)
    if config.cache_dir:
        flags.append(f"--cache_dir={config.cache_dir}")
    env = {
        "NEURON_CC_FLAGS": " ".join(flags),
        "NEURON_FUSE_SOFTMAX": "1" if config.fuse_softmax else "0",
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": str(config.inflight_requests),
        "MALLOC_ARENA_MAX": str(config.malloc_arena_max),
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1" if precision == "bf16-sr" else "0",
    }
    if config.cache_dir:
        env["NEURON_COMPILE_CACHE_URL"] = config.cache_dir
    if multi_node and config.efa:
        env.update(FI_PROVIDER="efa", FI_EFA_USE_DEVICE_RDMA="1", FI_EFA_FORK_SAFE="1")
    return env


def apply_neuron_env(config: NeuronConfig, precision: str, multi_node: bool) -> dict[str, str]:
    """Set :func:`neuron_env` in ``os.environ``; a variable the user already set wins.

    Returns what was set. Call before anything imports ``torch_xla``.
    """
    applied = {}
    for key, value in neuron_env(config, precision, multi_node).items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


_xla_model: Any = None
_xla_looked_up = False


def mark_step() -> Any:
    """End the traced XLA graph of this step (``xm.mark_step``); a no-op off Neuron.

    Note: ``torch_xla`` is looked up once per process; a failed import is not cached by
    Python, and retrying it every step would search the whole module path each time.
    """
    global _xla_model, _xla_looked_up
    if not _xla_looked_up:
        try:
            import torch_xla.core.xla_model as xm
        except Exception:  # not on an XLA device
            xm = None
        _xla_model, _xla_looked_up = xm, True
    return None if _xla_model is None else _xla_model.mark_step()
