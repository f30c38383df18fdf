"""AdamW for bf16 training: fp32 update math, stochastic rounding on write-back."""

from __future__ import annotations

import itertools
import math
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hlat_optim import _native
from hlat_optim.rounding import (
    _is_dtensor,
    _local,
    _lsr,
    hashed_bits,
    round_to_nearest,
    round_with_bits,
)

__all__ = ["AdamW", "adamw_update"]

_SUPPORTED = (torch.float32, torch.bfloat16)
_IMPLS = ("auto", "native", "compiled", "reference")
# An odd multiplier: the high 16 bits of (bits * it) are exp_avg_sq's rounding bits.
_SQ_MULT = 0x2C1B3C6D


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    master: torch.Tensor | None,
    hyper: torch.Tensor,
    key: torch.Tensor,
    offset: torch.Tensor,
    stochastic_rounding: bool,
    compensation: torch.Tensor | None = None,
) -> None:
    """One AdamW update of a flat (1-D, contiguous) parameter and its states, in place.

    This is the reference implementation; ``AdamW`` runs it as is (``impl="reference"``),
    through ``torch.compile`` or, on CPU, as the equivalent C++ loop in ``_adamw_cpu.cpp``;
    every path computes the same thing bit for bit.

    ``hyper`` is a float32 tensor ``[decay, step_size, 1 - beta1, beta2, 1 - beta2, eps,
    1 / bias_correction2_sqrt]`` with ``decay = 1 - lr * weight_decay``,
    ``step_size = lr / (1 - beta1**step)`` and ``bias_correction2_sqrt = sqrt(1 -
    beta2**step)``, computed in float64 on the host as torch does.
    ``key`` (0-d int32) seeds the rounding bits for this parameter and step; ``offset`` (0-d
    int32) is added to the element index so that a shard draws the bits its elements would
    draw in the whole tensor. With ``master`` (fp32) the update is applied to it and copied
    into ``param`` with round-to-nearest. With ``compensation`` (bf16, Kahan summation) the
    weight is ``param + compensation``: the update is applied to that sum, ``param`` gets it
    rounded to nearest and ``compensation`` what the rounding lost.

    Stochastic rounding draws 32 hashed bits per element (``hashed_bits``): the low 16 round
    the parameter, the high 16 ``exp_avg``, and the high 16 of ``bits * 0x2C1B3C6D`` (an
    odd multiplier) ``exp_avg_sq``. Those last are uniform and independent of the low 16.

    Note: the scalars arrive as tensors, not Python floats, so that a compiled kernel is
    reused across steps instead of being recompiled for every new learning rate.
    """
    decay, step_size, one_minus_beta1, beta2, one_minus_beta2, eps, inv_bc2_sqrt = hyper.unbind(0)
    g = grad.float()
    m = exp_avg.float()
    m = m + one_minus_beta1 * (g - m)
    v = exp_avg_sq.float() * beta2 + one_minus_beta2 * g * g
    # Note: eager CPU float32 sqrt is not correctly rounded in every torch build, while the
    # compiled kernel's is; eagerly, the float64 root rounded once is, so both paths agree
    # bit for bit.
    root = v.sqrt() if torch.compiler.is_compiling() else v.double().sqrt().float()
    # Note: torch divides by bias_correction2_sqrt; multiplying by its inverse (within one
    # ulp of that) leaves one division per element, and division is what bounds a
    # vectorised CPU step.
    denom = root * inv_bc2_sqrt + eps
    w = master if master is not None else param.float()
    if compensation is not None:
        w = w + compensation.float()
    w = w * decay
    w = w - step_size * (m / denom)

    param_sr = master is None and compensation is None and param.dtype == torch.bfloat16
    needs_bits = stochastic_rounding and (param_sr or exp_avg.dtype == torch.bfloat16)
    if needs_bits:
        index = torch.arange(param.numel(), dtype=torch.int32, device=param.device) + offset
        bits = hashed_bits(index, key)

    if master is not None:
        master.copy_(w)
        param.copy_(w)
    elif compensation is not None:
        rounded = round_to_nearest(w)
        param.copy_(rounded)
        compensation.copy_(w - rounded)  # exact in fp32; rounded to nearest bf16 on the copy
    elif param.dtype == torch.bfloat16 and stochastic_rounding:
        param.copy_(round_with_bits(w, bits & 0xFFFF))
    else:
        param.copy_(w)

    if exp_avg.dtype == torch.bfloat16 and stochastic_rounding:
        exp_avg.copy_(round_with_bits(m, _lsr(bits, 16)))
        exp_avg_sq.copy_(round_with_bits(v, _lsr(bits * _SQ_MULT, 16)))
    else:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


_compiled: Callable[..., None] | None = None
_compile_lock = threading.Lock()


def _compiled_update() -> Callable[..., None]:
    global _compiled
    with _compile_lock:
        if _compiled is None:
            compiled = torch.compile(adamw_update, dynamic=True, fullgraph=True)

            def run(*args: Any) -> None:
                # Note: every combination of parameter and state dtypes, master weights or
                # Kahan compensation, and rounding mode is its own graph (two dozen at most);
                # torch's default limit of 8 graphs per function would make a process that
                # uses several modes fail.
                with torch._dynamo.config.patch(recompile_limit=64):
                    compiled(*args)

            _compiled = run
    return _compiled


def _step_key(seed: int, step: int, index: int, salt: int) -> int:
    """A 32-bit key from (seed, step, parameter index, shard salt), as a signed int32."""
    h = 0
    for word in (seed, step, index, salt):
        h = (h ^ (word & 0xFFFFFFFF)) * 0x9E3779B1 & 0xFFFFFFFF
        h ^= h >> 16
        h = h * 0x85EBCA6B & 0xFFFFFFFF
        h ^= h >> 13
    return h - (1 << 32) if h >= 1 << 31 else h


def _shard_layout(p: torch.Tensor) -> tuple[int, int]:
    """(index offset, key salt) of a parameter's local shard within its global tensor.

    A plain tensor or a replicated DTensor gives (0, 0), so replicas round identically. A
    shard that is a contiguous range of the global tensor (sharded on dim 0) gets its flat
    offset, so it draws exactly the bits the unsharded tensor would; any other shard gets a
    distinct salt instead, so no two shards share a random stream.
    """
    if not _is_dtensor(p):
        return 0, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    d: Any = p
    local_shape, global_offset = compute_local_shape_and_global_offset(
        d.shape, d.device_mesh, d.placements
    )
    flat = 0
    for off, stride in zip(
        global_offset, torch.empty(p.shape, device="meta").stride(), strict=True
    ):
        flat += off * stride
    if tuple(local_shape[1:]) == tuple(p.shape[1:]):
        return flat, 0
    return 0, flat + 1


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay for fp32 and bf16 parameters.

    Precision modes (bytes per parameter: parameter + gradient + states):

    - bf16 parameters, ``stochastic_rounding=True`` (default, HLAT's mode): the update is
      computed in fp32 and written back with unbiased stochastic rounding; states in bf16
      (8 bytes, the default for bf16 parameters) or fp32 (``state_dtype=torch.float32``, 12).
    - bf16 parameters, ``stochastic_rounding=False``: round-to-nearest write-back, which
      loses updates smaller than half a bf16 ulp (to reproduce the failure).
    - ``kahan_sum=True``: bf16 parameters with a bf16 Kahan compensation each; the update is
      applied to ``parameter + compensation`` and written back with round-to-nearest, the
      rounding error kept in the compensation (10 bytes with bf16 states). States are rounded
      as ``stochastic_rounding`` says.
    - ``master_weights=True``: an fp32 copy of every bf16 parameter takes the update and is
      copied into the parameter with round-to-nearest (mixed precision, 16 bytes).
    - fp32 parameters: plain fp32 AdamW, equal to ``torch.optim.AdamW`` (16 bytes).

    Weight decay is applied to every parameter, norm weights included, unless a param group
    sets ``weight_decay=0``. ``lr`` may be a float or a tensor and is driven by any
    ``torch.optim.lr_scheduler``.

    Rounding bits come from a counter-based hash of (element index, ``seed``, step,
    parameter index), so the whole rounding state is the ``seed`` (in every param group)
    and each parameter's ``step`` (in its state): ``state_dict()`` holds both and resume is
    bit-exact. DTensor parameters are updated shard by shard; a shard of dim 0 rounds exactly
    as the whole tensor would.

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay: as in ``torch.optim.AdamW``.
        stochastic_rounding: round bf16 parameters and bf16 states stochastically.
        state_dtype: dtype of ``exp_avg``/``exp_avg_sq``; ``None`` means the parameter's
            dtype (fp32 when ``master_weights``).
        master_weights: keep an fp32 master copy of bf16 parameters.
        kahan_sum: keep a bf16 Kahan compensation of bf16 parameters instead.
        seed: seed of the rounding bits.
        impl: ``"native"`` (a vectorised C++ loop for CPU tensors, built on first use with
            the host compiler), ``"compiled"`` (``torch.compile``d update), ``"reference"``
            (the same update run eagerly) or ``"auto"``: native for CPU tensors when it
            builds, compiled otherwise, and the reference with a warning if compilation
            fails. All give bit-identical results.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        stochastic_rounding: bool = True,
        state_dtype: torch.dtype | None = None,
        master_weights: bool = False,
        kahan_sum: bool = False,
        seed: int = 0,
        impl: str = "auto",
    ) -> None:
        if not float(lr) >= 0.0:
            raise ValueError(f"AdamW: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW: betas must be in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"AdamW: eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamW: weight_decay must be >= 0, got {weight_decay}")
        if state_dtype not in (None, *_SUPPORTED):
            raise ValueError(
                f"AdamW: state_dtype must be None, torch.float32 or torch.bfloat16, "
                f"got {state_dtype}"
            )
        if kahan_sum and master_weights:
            raise ValueError(
                "AdamW: kahan_sum and master_weights are two ways to keep the bits a bf16 "
                "write-back loses; choose one"
            )
        if impl not in _IMPLS:
            raise ValueError(f"AdamW: impl must be one of {', '.join(_IMPLS)}, got {impl!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, seed=seed)
        super().__init__(params, defaults)
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.dtype not in _SUPPORTED:
                    raise TypeError(
                        f"AdamW: parameter {pi} of param group {gi} (shape {tuple(p.shape)}) "
                        f"is {p.dtype}; only float32 and bfloat16 parameters are supported "
                        "(cast the model with .to(torch.bfloat16) or .float())"
                    )
        self.stochastic_rounding = stochastic_rounding
        self.state_dtype = state_dtype
        self.master_weights = master_weights
        self.kahan_sum = kahan_sum
        self.impl = impl
        self._layouts: dict[torch.Tensor, tuple[int, int]] = {}

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        master = self.master_weights and p.dtype == torch.bfloat16
        dtype = self.state_dtype or (torch.float32 if master else p.dtype)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(
            p, dtype=dtype, memory_format=torch.contiguous_format
        )
        if master:
            state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format)
        if self.kahan_sum and p.dtype == torch.bfloat16:
            state["compensation"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()``, keeping each state tensor's saved dtype.

        Note: ``torch.optim.Optimizer`` casts floating-point state to the parameter's dtype on
        load, which would turn fp32 master weights and fp32 moments of bf16 parameters into
        bf16; the saved tensors are put back with their own dtype afterwards.
        """
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(ids, params, strict=True):
            for name, value in saved.get(pid, {}).items():
                if torch.is_tensor(value) and name != "step" and value.dtype != p.dtype:
                    self.state[p][name] = value.detach().to(_local(p).device, copy=True)

    def _native_reason(self, local: list[torch.Tensor | None]) -> str | None:
        """Why the CPU kernel cannot update this parameter, or None if it can."""
        grad = local[1]
        assert grad is not None
        if not all(t.device.type == "cpu" for t in local if t is not None):
            return "it runs on CPU tensors only"
        if grad.dtype not in _SUPPORTED:
            return f"the gradient is {grad.dtype}, not float32 or bfloat16"
        if _native.load() is None:
            return f"the kernel could not be built: {_native.unavailable_reason()}"
        return None

    def _update_fn(self) -> Callable[..., None]:
        if self.impl == "reference":
            return adamw_update
        return _compiled_update()

    def _run(self, *args: Any) -> None:
        fn = self._update_fn()
        if fn is adamw_update:
            fn(*args)
            return
        try:
            fn(*args)
        except Exception as exc:
            if self.impl == "compiled":
                raise
            warnings.warn(
                f"hlat_optim.AdamW: torch.compile of the update failed ({type(exc).__name__}: "
                f"{exc}); using the eager reference update from now on (same results, slower). "
                "Pass impl='reference' to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
            self.impl = "reference"
            adamw_update(*args)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo: list[tuple[dict[str, Any], torch.Tensor, int]] = []
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"hlat_optim.AdamW: parameter {index} has a sparse gradient, which is "
                        "not supported"
                    )
                todo.append((group, p, index))
        # Everything that can fail is checked before any state changes.
        prepared = []
        for group, p, index in todo:
            state = self.state[p]
            if not state:
                self._init_state(p, state)
            local, offset, salt = self._locals(p, state, index)
            native = False
            if self.impl in ("auto", "native"):
                why = self._native_reason(local)
                if why is not None and self.impl == "native":
                    raise RuntimeError(f"hlat_optim.AdamW(impl='native'): {why}")
                native = why is None
            prepared.append((group, state, index, local, offset, salt, native))
        counters = [state["step"] for _, state, *_ in prepared]
        if counters:
            torch._foreach_add_(counters, 1.0)  # one call for all parameters' step counts
        batch = _NativeBatch()
        for group, state, index, local, offset, salt, native in prepared:
            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            step = int(state["step"].item())
            hyper = [
                1.0 - lr * group["weight_decay"],
                lr / (1.0 - beta1**step),
                1.0 - beta1,
                beta2,
                1.0 - beta2,
                group["eps"],
                1.0 / math.sqrt(1.0 - beta2**step),
            ]
            key = _step_key(group["seed"], step, index, salt)
            if native:
                batch.add(local, hyper, key, offset, self.stochastic_rounding, index)
                continue
            flat = [t.view(-1) if t is not None else None for t in local]
            device = flat[0].device  # type: ignore[union-attr]
            self._run(
                *flat[:5],
                torch.tensor(hyper, dtype=torch.float32, device=device),
                torch.tensor(key, dtype=torch.int32, device=device),
                torch.tensor(offset, dtype=torch.int32, device=device),
                self.stochastic_rounding,
                flat[5],
            )
        batch.run(None)
        return loss

    def _locals(
        self, p: torch.Tensor, state: dict[str, Any], index: int
    ) -> tuple[list[torch.Tensor | None], int, int]:
        """The contiguous local tensors of one update (parameter, gradient, states, master
        weights, compensation), and the index offset and key salt of its shard."""
        if p not in self._layouts:
            self._layouts[p] = _shard_layout(p)
        offset, salt = self._layouts[p]
        grad: Any = p.grad
        pd: Any = p
        if _is_dtensor(grad) and _is_dtensor(p) and tuple(grad.placements) != tuple(pd.placements):
            # Note: DTensor's autograd may leave a gradient in another layout than its
            # parameter (a vocab-parallel embedding's comes back Replicate, a sequence-
            # parallel norm weight's Partial); the update works on local shards, so the
            # gradient is brought to the parameter's layout first.
            grad = grad.redistribute(pd.device_mesh, pd.placements)
        tensors = [
            p,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state.get("master"),
            state.get("compensation"),
        ]
        local = [_local(t) if t is not None else None for t in tensors]
        if not all(t is None or t.is_contiguous() for t in local):
            raise RuntimeError(
                f"hlat_optim.AdamW: parameter {index} (shape {tuple(p.shape)}) or its gradient "
                "is not contiguous; call .contiguous() on the parameter before building the "
                "optimizer"
            )
        return local, offset, salt


class _NativeBatch:
    """The updates of one step that go to the CPU kernel, made in one call at the end."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = []
        self.hypers: list[list[float]] = []
        self.indices: list[int] = []
        self.keep: list[list[torch.Tensor | None]] = []  # alive until the call

    def add(
        self,
        local: list[torch.Tensor | None],
        hyper: list[float],
        key: int,
        offset: int,
        stochastic_rounding: bool,
        index: int,
    ) -> None:
        param, grad, exp_avg, exp_avg_sq, master, compensation = local
        assert param is not None and grad is not None
        assert exp_avg is not None and exp_avg_sq is not None
        bf16 = torch.bfloat16
        flags = (
            (param.dtype == bf16)
            | (grad.dtype == bf16) << 1
            | (exp_avg.dtype == bf16) << 2
            | bool(stochastic_rounding) << 3
        )
        self.rows.append(
            [
                param.data_ptr(),
                grad.data_ptr(),
                exp_avg.data_ptr(),
                exp_avg_sq.data_ptr(),
                master.data_ptr() if master is not None else 0,
                compensation.data_ptr() if compensation is not None else 0,
                param.numel(),
                flags,
                key & 0xFFFFFFFF,
                offset & 0xFFFFFFFF,
            ]
        )
        self.hypers.append(hyper)
        self.indices.append(index)
        self.keep.append(local)

    def run(self, skip: torch.Tensor | None) -> None:
        """One kernel call; ``skip`` (a CPU bool tensor or None) is read by the kernel."""
        if not self.rows:
            return
        lib = _native.load()
        assert lib is not None
        table = torch.tensor(self.rows, dtype=torch.int64)
        hypers = torch.tensor(self.hypers, dtype=torch.float32)
        rc = lib.hlat_adamw_step(
            len(self.rows),
            table.data_ptr(),
            hypers.data_ptr(),
            torch.get_num_threads(),
            skip.data_ptr() if skip is not None else None,
        )
        if rc != 0:
            raise RuntimeError(
                f"hlat_optim.AdamW: the CPU kernel rejected parameter {self.indices[rc - 1]}'s "
                "combination of dtypes and states"
            )
