"""hlat-model: a fused Llama in plain PyTorch.

>>> from hlat_model import Llama, LlamaConfig
>>> model = Llama(LlamaConfig.preset("tiny"))
"""

from hlat_model._native import fused_cpu_kernels_reason
from hlat_model.attention import (
    amx_attention_reason,
    bf16_flash_attention_reason,
    fp32_flash_attention_reason,
)
from hlat_model.config import PRESETS, ConfigError, LlamaConfig
from hlat_model.loss import cross_entropy_loss, linear_cross_entropy
from hlat_model.model import Llama, block_inputs, flops_per_token

__version__ = "0.32.1"

__all__ = [
    "PRESETS",
    "ConfigError",
    "Llama",
    "LlamaConfig",
    "amx_attention_reason",
    "bf16_flash_attention_reason",
    "block_inputs",
    "cross_entropy_loss",
    "flops_per_token",
    "fp32_flash_attention_reason",
    "fused_cpu_kernels_reason",
    "linear_cross_entropy",
]
