"""Stochastic rounding of fp32 to bf16 with the integer bit trick.

bf16 is the upper half of an fp32 bit pattern. Adding a uniform random integer in
``[0, 2**16)`` to the fp32 bits and dropping the lower 16 bits rounds the magnitude up with
probability equal to the dropped fraction of one bf16 ulp, so ``E[round(x)] == x``.
Sign-magnitude encoding makes the same addition correct for negative values, subnormals
need no special case, and values already representable in bf16 have zero low bits and are
returned exactly.

Two random sources feed the same bit trick: a ``torch.Generator`` (``stochastic_round``,
for general use) and a counter-based integer hash of (element index, key)
(``hashed_bits``, used inside the optimizer so that a compiled kernel can draw its own bits
and a checkpoint only needs ``(seed, step)``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "hashed_bits",
    "mix32",
    "round_to_nearest",
    "round_with_bits",
    "stochastic_round",
    "stochastic_round_",
]

_LOW_MASK = -(1 << 16)  # 0xFFFF0000 as a signed int32
_EXP_MASK = 0x7F800000
_MANT_MASK = 0x007FFFFF
_QUIET_NAN_BIT = 0x00400000
_BF16_ULP = 1 << 16

# lowbias32 multipliers (a well-studied 32-bit integer finaliser), as signed int32 values.
_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)
_GOLDEN = 0x9E3779B1 - (1 << 32)


def _lsr(h: torch.Tensor, shift: int) -> torch.Tensor:
    # torch's >> on int32 is arithmetic; masking off the sign-extended bits makes it logical.
    return (h >> shift) & ((1 << (32 - shift)) - 1)


def mix32(h: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche mix of int32 values (wrapping arithmetic).

    Elementwise integer ops only, so ``torch.compile`` fuses it into the kernel that uses it.
    """
    h = h ^ _lsr(h, 16)
    h = h * _M1
    h = h ^ _lsr(h, 15)
    h = h * _M2
    return h ^ _lsr(h, 16)


def hashed_bits(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """32 pseudo-random bits (int32) per element from a counter-based hash of
    ``(index, key)``; ``key`` is a 0-d int32 tensor that changes every step.

    Note: a counter-based hash instead of ``torch.randint``: it needs no state beyond the
    key, runs inside a compiled kernel at memory speed, and gives the same bits on every
    device and in every execution path.
    """
    return mix32(index * _GOLDEN + key)


def round_with_bits(x: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 using ``bits16`` (int32 values in ``[0, 2**16)``).

    Finite inputs stay finite: a value between the largest bf16 (about 3.39e38) and the
    largest fp32 rounds down to the largest bf16 instead of overflowing to inf.
    ±inf are preserved and NaN stays NaN (sign kept, quieted).

    Note: saturating at the bf16 maximum is a deliberate departure from exact unbiasedness
    in that last binade above it: an inf written into a weight is unrecoverable, while the
    bias of saturating is at most one ulp of a value nobody trains at.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic rounding expects a float32 tensor, got {x.dtype}")
    i = x.view(torch.int32)
    rounded = (i + bits16) & _LOW_MASK
    special = (i & _EXP_MASK) == _EXP_MASK  # inf or NaN on input
    overflowed = (rounded & _EXP_MASK) == _EXP_MASK
    # Stepping one bf16 ulp down from the inf pattern gives the largest finite bf16.
    rounded = torch.where(overflowed, rounded - _BF16_ULP, rounded)
    kept = (i & _LOW_MASK) | (((i & _MANT_MASK) != 0).to(torch.int32) * _QUIET_NAN_BIT)
    rounded = torch.where(special, kept, rounded)
    return rounded.view(torch.float32).to(torch.bfloat16)


def round_to_nearest(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to the nearest bf16 (ties to even), as an fp32 tensor.

    The same values as ``x.to(torch.bfloat16).float()``, computed on the bit pattern: a
    compiled kernel may drop a round trip through bf16 as a no-op, but not these integer ops.
    NaN stays NaN; values past the largest bf16 round to inf, as torch's cast does.
    """
    i = x.view(torch.int32)
    rounded = (i + (_lsr(i, 16) & 1) + 0x7FFF) & _LOW_MASK
    return torch.where(x.isnan(), x, rounded.view(torch.float32))


def _local(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: writes reach the DTensor), else ``x``."""
    d: Any = x
    return d.to_local() if _is_dtensor(x) else x


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _is_dtensor(x: torch.Tensor) -> bool:
    if type(x) in _PLAIN:  # the common case, without an import
        return False
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch built without distributed
        return False
    return isinstance(x, DTensor)


def _random_bits16(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.randint(
        0, _BF16_ULP, like.shape, dtype=torch.int32, device=like.device, generator=generator
    )


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Unbiased stochastic rounding of a float32 tensor to bfloat16.

    Each element rounds to one of its two bf16 neighbours with probabilities proportional to
    its distance from the other, so the expected result equals ``x``. Values already
    representable in bf16 come back exactly; ±inf and NaN are preserved; finite values never
    become inf (see ``round_with_bits``). Pass a ``torch.Generator`` on ``x``'s device for
    reproducible results. A DTensor is rounded shard by shard and returned as a DTensor
    with the same placements.

    Note: with a ``Replicate`` DTensor every rank draws its own bits; give each rank a
    generator seeded alike if the replicas must stay identical.
    """
    if x.dtype != torch.float32:
        raise TypeError(
            f"stochastic_round expects a float32 tensor, got {x.dtype}; "
            "convert with x.float() first"
        )
    if _is_dtensor(x):
        from torch.distributed.tensor import DTensor

        d: Any = x
        local = stochastic_round(d.to_local(), generator)
        return DTensor.from_local(
            local, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
        )
    return round_with_bits(x, _random_bits16(x, generator))


def stochastic_round_(
    out: torch.Tensor, x: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Write ``stochastic_round(x)`` into the existing bfloat16 tensor ``out``; returns ``out``.

    ``out`` and ``x`` may both be DTensors with the same placements (their local shards are
    used).
    """
    if out.dtype != torch.bfloat16:
        raise TypeError(f"stochastic_round_ writes into a bfloat16 tensor, got {out.dtype}")
    if out.shape != x.shape:
        raise ValueError(
            f"stochastic_round_: out has shape {tuple(out.shape)} but x has {tuple(x.shape)}"
        )
    local_out, local_x = _local(out), _local(x)
    local_out.copy_(stochastic_round(local_x, generator))
    return out
