"""hlat-optim: AdamW with bf16 stochastic rounding, cosine warmup and global-norm clipping.

>>> from hlat_optim import AdamW, clip_grad_norm_, cosine_with_warmup, stochastic_round
"""

from hlat_optim.adamw import AdamW, adamw_update
from hlat_optim.clip import NonFiniteGradNormError, clip_coefficient, clip_grad_norm_, global_norm
from hlat_optim.rounding import stochastic_round, stochastic_round_
from hlat_optim.schedule import CosineWithWarmup, cosine_with_warmup

__version__ = "0.13.2"

__all__ = [
    "AdamW",
    "CosineWithWarmup",
    "NonFiniteGradNormError",
    "adamw_update",
    "clip_coefficient",
    "clip_grad_norm_",
    "cosine_with_warmup",
    "global_norm",
    "stochastic_round",
    "stochastic_round_",
]
