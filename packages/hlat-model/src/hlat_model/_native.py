"""The fused CPU kernels of ``_fused_cpu.cpp`` (RMSNorm, SwiGLU, the RoPE head split, the
cross entropy of rows of logits and the blocked attention's softmax, forward and backward),
built on first use and called through ctypes.

The library is compiled once per machine type by the host C++ compiler (``$CXX``, else
``c++``, ``g++`` or ``clang++``), as ``torch.compile`` compiles its CPU kernels at run time,
into ``$HLAT_MODEL_CACHE_DIR`` (else ``$XDG_CACHE_HOME/hlat-model`` or
``~/.cache/hlat-model``), keyed by the source, the flags, the compiler and the CPU's feature
flags, so a home directory shared by a cluster of mixed machines never loads a library built
for another CPU. ``$HLAT_MODEL_CXXFLAGS`` adds flags (e.g. ``-march=x86-64-v3`` for the
oldest CPU of a mixed cluster). ``HLAT_MODEL_NATIVE=0`` turns the kernels off; where no
compiler works, :func:`load` returns ``None`` and :func:`unavailable_reason` says why. Either
way the model computes the same functions with torch's operators.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

_SOURCE = Path(__file__).with_name("_fused_cpu.cpp")
_ABI = 14
# -fno-trapping-math lets the compiler vectorise floor(); no -ffast-math: NaN and inf keep
# their meaning.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-std=c++17"]
_X86_FLAGS = ["-mprefer-vector-width=512"]  # full-width AVX-512 where the CPU has it
# with OpenMP (rows split over torch's threads), then without
_VARIANTS: tuple[list[str], ...] = (["-fopenmp"], [])

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "hlat_rms_norm_forward": [_INT, _P, _P, _P, _P, _I64, _I64, ctypes.c_float, _INT],
    "hlat_add_rms_norm_forward": [_INT, _P, _P, _P, _P, _P, _P, _I64, _I64, ctypes.c_float, _INT],
    "hlat_rms_norm_backward": [_INT, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _INT, _INT],
    "hlat_swiglu_forward": [_INT, _P, _P, _I64, _I64, _INT, _INT],
    "hlat_swiglu_backward": [_INT, _P, _P, _P, _I64, _I64, _INT, _INT],
    "hlat_rope_heads": [_INT, _P, _P, _P, _P, _P, _P, _P, _INT, _INT],
    "hlat_xent_forward": [_INT, _P, _I64, _I64, _P, _P, _P, _P, _INT],
    "hlat_xent_backward": [_INT, _P, _I64, _I64, _P, _P, _P, _P, _INT],
    "hlat_xent_first_bad": [_P, _I64, _I64, _I64],
    "hlat_attn_softmax": [_INT, _P, _I64, _I64, _I64, _I64, _INT],
    "hlat_attn_softmax_backward": [_INT, _P, _P, _I64, _I64, _I64, _I64, _INT],
    "hlat_add_bf16_into_fp32": [_P, _I64, _P, _I64, _I64, _INT],
    "hlat_attn_amx_ready": [],
    "hlat_attn_bf16_ready": [],
    "hlat_attn_f32_ready": [],
}
# the flash attention kernels: fp32 on AVX-512 or AVX2, and bf16 (the same arguments after a
# first one: 1 for AMX tiles, 0 for AVX512-BF16 dot products); the pointer before the thread
# count is each query's first key (packed documents), or null
_FLASH_FORWARD = [_P, _P, _P, _P, _I64, _I64, _I64, _P] + [_I64] * 5 + [ctypes.c_float, _P, _INT]
_FLASH_BACKWARD = (
    [_P, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64]
    + [_P] * 4
    + [_I64] * 5
    + [ctypes.c_float, _P, _INT]
)
_SIGNATURES["hlat_attn_f32_forward"] = _FLASH_FORWARD
_SIGNATURES["hlat_attn_f32_backward"] = _FLASH_BACKWARD
_SIGNATURES["hlat_attn_bf16_forward"] = [_INT, *_FLASH_FORWARD]
_SIGNATURES["hlat_attn_bf16_backward"] = [_INT, *_FLASH_BACKWARD]
# the bf16 kernel reading q, k and v from the fused product, RoPE applied as it reads them
_SIGNATURES["hlat_attn_bf16_rope_forward"] = (
    [_INT] + [_P] * 5 + [_I64] * 3 + [_P, ctypes.c_float, _P, _INT]
)
_SIGNATURES["hlat_attn_bf16_rope_backward"] = (
    [_INT] + [_P] * 5 + [_I64] * 3 + [_P] + [_I64] * 3 + [_P, _P, ctypes.c_float, _P, _INT]
)
_RETURNS: dict[str, type[ctypes.c_int64] | type[ctypes.c_int]] = {
    "hlat_xent_first_bad": ctypes.c_int64
}
_RETURNS.update(
    (name, _INT)
    for kind in ("amx", "bf16", "f32", "bf16_rope")
    for what in ("ready", "forward", "backward")
    if (name := f"hlat_attn_{kind}_{what}") in _SIGNATURES
)

_PARTS = 64
"""Row parts whose weight-gradient sums RMSNorm's backward adds up: a fixed number, so that
its result is the same for any thread count."""

_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    """Where built libraries are kept."""
    if os.environ.get("HLAT_MODEL_CACHE_DIR"):
        return Path(os.environ["HLAT_MODEL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hlat-model"


def _machine_key(compiler: str, flags: list[str]) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    features = platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        features = next(
            (line for line in text.splitlines() if line.startswith(("flags", "Features"))),
            features,
        )
    except OSError:
        pass
    digest = hashlib.sha256()
    for part in (_SOURCE.read_text(), " ".join(flags), version, features):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:20]


def _compile(compiler: str, flags: list[str]) -> Path:
    target = cache_dir() / f"fused_cpu_{_machine_key(compiler, flags)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a unique name, then renamed: ranks starting together may all build it.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, "-shared", "-fPIC", str(_SOURCE), "-o", partial],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} exited {done.returncode}: {done.stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def _open(path: Path) -> ctypes.CDLL:
    # torch is imported first, so the OpenMP runtime the library links resolves to the one
    # torch loaded: one thread pool.
    lib = ctypes.CDLL(str(path))
    if lib.hlat_model_abi() != _ABI:
        raise RuntimeError(f"{path} has other entry points than this hlat-model's")
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = _RETURNS.get(name)
    return lib


def load() -> ctypes.CDLL | None:
    """The kernels' library, built on first call; ``None`` where it cannot be (see
    :func:`unavailable_reason`)."""
    if "lib" in _state:  # every call after the first: no lock on the hot path
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib, reason = None, None
        compiler = next(
            (c for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)),
            None,
        )
        if os.environ.get("HLAT_MODEL_NATIVE", "1") == "0":
            reason = "turned off by HLAT_MODEL_NATIVE=0"
        elif compiler is None:
            reason = "no C++ compiler found (set CXX)"
        else:
            base = _FLAGS + (_X86_FLAGS if platform.machine() in ("x86_64", "AMD64") else [])
            base += shlex.split(os.environ.get("HLAT_MODEL_CXXFLAGS", ""))
            errors = []
            for extra in _VARIANTS:
                try:
                    lib = _open(_compile(compiler, base + extra))
                    break
                except (OSError, RuntimeError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
            reason = None if lib is not None else "; ".join(errors)
        _state.update(lib=lib, reason=reason)
        return lib


def fused_cpu_kernels_reason() -> str | None:
    """``None`` where the fused CPU kernels run (building them on first call), else why
    not: the model then computes the same functions with torch's operators."""
    return None if load() is not None else unavailable_reason()


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (after it was called), else ``None``."""
    return _state.get("reason")  # type: ignore[return-value]


def reset() -> None:
    """Forget the loaded library, so that the next :func:`load` looks again."""
    with _lock:
        _state.clear()


def usable(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, if these tensors can go to its kernels: plain contiguous CPU tensors,
    all fp32 or all bf16, computed op by op (not traced by ``torch.compile``)."""
    first = tensors[0]
    if first.dtype not in (torch.float32, torch.bfloat16) or torch.compiler.is_compiling():
        return None
    for t in tensors:
        if (
            t.device.type != "cpu"
            or t.dtype != first.dtype
            or not t.is_contiguous()
            or type(t) not in (torch.Tensor, torch.nn.Parameter)
        ):
            return None
    return load()


def _bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def _plain(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a plain tensor whose ``data_ptr`` holds its values: an
    ``AsyncCollectiveTensor`` (what a functional collective upstream returns, as under
    sequence parallelism) is waited for and unwrapped; any other tensor subclass is refused,
    its pointer being no buffer of its values."""
    if type(grad) is torch.Tensor:
        return grad
    if torch.distributed.is_available():
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        if isinstance(grad, AsyncCollectiveTensor):
            return grad.wait()
    raise TypeError(
        f"hlat-model's CPU kernels take plain tensors; a gradient arrived as {type(grad).__name__}"
    )


def rms_norm_forward(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``round(round(x * rstd) * weight)``, fp32 ``rstd`` of each row [rows])."""
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    out = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32)
    lib.hlat_rms_norm_forward(
        _bf16(x), x.data_ptr(), weight.data_ptr(), out.data_ptr(), rstd.data_ptr(),
        rows, dim, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, rstd


def add_rms_norm_forward(
    lib: ctypes.CDLL, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``total = round(x + delta)``, :func:`rms_norm_forward` of ``total``), in one pass
    over the rows: ``(total, normed, rstd)``."""
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    total, out = torch.empty_like(x), torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32)
    lib.hlat_add_rms_norm_forward(
        _bf16(x), x.data_ptr(), delta.data_ptr(), weight.data_ptr(), total.data_ptr(),
        out.data_ptr(), rstd.data_ptr(), rows, dim, eps, torch.get_num_threads(),
    )  # fmt: skip
    return total, out, rstd


def rms_norm_backward(
    lib: ctypes.CDLL,
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`rms_norm_forward`'s output for ``x`` and ``weight``; with
    ``residual`` (a gradient of ``x``'s shape from elsewhere, as a residual stream's), the
    sum of it and the norm's gradient for ``x``, rounded once."""
    grad = _plain(grad).contiguous()
    res_ptr = None
    if residual is not None:
        residual = _plain(residual).to(x.dtype).contiguous()
        res_ptr = residual.data_ptr()
    dim = x.shape[-1]
    rows = rstd.numel()
    threads = torch.get_num_threads()
    parts = max(1, min(_PARTS, rows))
    grad_x, grad_w = torch.empty_like(x), torch.empty_like(weight)
    scratch = torch.empty(parts, dim, dtype=torch.float32)
    lib.hlat_rms_norm_backward(
        _bf16(x), grad.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), res_ptr,
        grad_x.data_ptr(), grad_w.data_ptr(), scratch.data_ptr(), rows, dim, parts, threads,
    )  # fmt: skip
    return grad_x, grad_w


def swiglu_forward(
    lib: ctypes.CDLL, gate_up: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` (the halves of the last dimension),
    or with ``interleaved`` of gate and up alternating (``[gate_0, up_0, gate_1, ...]``)."""
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    lib.hlat_swiglu_forward(
        _bf16(gate_up), gate_up.data_ptr(), out.data_ptr(), out.numel() // max(width, 1),
        width, int(interleaved), torch.get_num_threads(),
    )  # fmt: skip
    return out


def swiglu_backward(
    lib: ctypes.CDLL, grad: torch.Tensor, gate_up: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """The gradient of :func:`swiglu_forward`'s output for ``gate_up`` (its layout)."""
    grad = _plain(grad).contiguous()
    width = gate_up.shape[-1] // 2
    out = torch.empty_like(gate_up)
    lib.hlat_swiglu_backward(
        _bf16(gate_up), grad.data_ptr(), gate_up.data_ptr(), out.data_ptr(),
        grad.numel() // max(width, 1), width, int(interleaved), torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope_tables_usable(cos: torch.Tensor, sin: torch.Tensor, qkv_shape: torch.Size) -> bool:
    """Whether ``cos`` and ``sin`` are tables the RoPE kernel reads for a fused ``qkv`` of
    ``qkv_shape`` ([B, S, G, P, D], D even): fp32 CPU tensors of one layout, [B or 1, S, 1,
    D / 2] with rows of unit stride."""
    batch, seq, head_dim = qkv_shape[0], qkv_shape[1], qkv_shape[-1]
    return (
        cos.dim() == 4
        and head_dim % 2 == 0
        and cos.shape[-1] * 2 == head_dim
        and cos.dtype == sin.dtype == torch.float32
        and cos.device.type == sin.device.type == "cpu"
        and type(cos) is type(sin) is torch.Tensor
        and cos.shape == sin.shape
        and cos.stride() == sin.stride()
        and cos.shape[0] in (1, batch)
        and cos.shape[1] == seq
        and cos.shape[2] == 1
        and cos.stride(-1) == 1
    )


def _table_strides(cos: torch.Tensor) -> tuple[int, int]:
    """The element strides of RoPE's tables (``cos`` and ``sin`` alike) over batch (0 where
    one row serves every batch) and position."""
    return (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)


def _heads_table(shape: torch.Size, cos: torch.Tensor) -> ctypes.Array:
    batch, seq, groups, per_group, head_dim = shape
    values = (batch, seq, groups, per_group - 2, head_dim, *_table_strides(cos))
    return (ctypes.c_int64 * len(values))(*values)


def rope_heads_forward(
    lib: ctypes.CDLL, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v ([B, heads, S, D], contiguous) out of ``qkv`` [B, S, G, P, D], RoPE
    applied to q and k (``hlat_model.model.apply_rope``'s half-split pairs)."""
    batch, seq, groups, per_group, head_dim = qkv.shape
    q = qkv.new_empty(batch, groups * (per_group - 2), seq, head_dim)
    k, v = (qkv.new_empty(batch, groups, seq, head_dim) for _ in range(2))
    lib.hlat_rope_heads(
        _bf16(qkv), _heads_table(qkv.shape, cos), qkv.data_ptr(), q.data_ptr(), k.data_ptr(),
        v.data_ptr(), cos.data_ptr(), sin.data_ptr(), 0, torch.get_num_threads(),
    )  # fmt: skip
    return q, k, v


def rope_heads_backward(
    lib: ctypes.CDLL,
    shape: torch.Size,
    grads: tuple[torch.Tensor | None, ...],
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The gradient of :func:`rope_heads_forward` for ``qkv`` (of ``shape``) from those of
    q, k and v (None: zero)."""
    sample = next(g for g in grads if g is not None)
    dq, dk, dv = (None if g is None else _plain(g).contiguous() for g in grads)
    out = sample.new_empty(shape)
    lib.hlat_rope_heads(
        _bf16(out), _heads_table(shape, cos), out.data_ptr(),
        *(0 if g is None else g.data_ptr() for g in (dq, dk, dv)),
        cos.data_ptr(), sin.data_ptr(), 1, torch.get_num_threads(),
    )  # fmt: skip
    return out


def cross_entropy_forward(
    lib: ctypes.CDLL,
    logits: torch.Tensor,
    targets: torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, the target's logit) of each row of ``logits`` [rows, vocab], fp32
    (written into ``out``, two contiguous fp32 vectors, where given); ``targets`` are
    contiguous int64 column indices (one outside ``[0, vocab)``: picked 0). With
    ``grad_scale`` (contiguous fp32 [rows]) each row is overwritten with its logits'
    gradient, ``(softmax - onehot(target)) * grad_scale[row]``, rounded once to the logits'
    dtype."""
    rows, vocab = logits.shape
    if grad_scale is not None and (
        grad_scale.dtype != torch.float32
        or grad_scale.shape != (rows,)
        or not grad_scale.is_contiguous()
    ):
        raise ValueError(
            f"grad_scale must be a contiguous fp32 vector of {rows} rows, got "
            f"{grad_scale.dtype} of shape {tuple(grad_scale.shape)}"
        )
    lse, picked = out or tuple(torch.empty(rows, dtype=torch.float32) for _ in range(2))
    lib.hlat_xent_forward(
        _bf16(logits), logits.data_ptr(), rows, vocab, targets.data_ptr(), lse.data_ptr(),
        picked.data_ptr(), None if grad_scale is None else grad_scale.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return lse, picked


def cross_entropy_backward(
    lib: ctypes.CDLL,
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """``(softmax(logits) - onehot(targets)) * scale[:, None]`` in the logits' dtype, from
    the rows' log-sum-exp ``lse`` (fp32, as :func:`cross_entropy_forward` gives)."""
    rows, vocab = logits.shape
    scale = _plain(scale).contiguous()
    grad = torch.empty_like(logits)
    lib.hlat_xent_backward(
        _bf16(logits), logits.data_ptr(), rows, vocab, targets.data_ptr(), lse.data_ptr(),
        scale.data_ptr(), grad.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return grad


def check_labels(lib: ctypes.CDLL, labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Refuse a label that is neither ``ignore_index`` nor in ``[0, vocab)`` (the kernels
    would take it for an ignored row), before any work; ``labels`` are contiguous int64 CPU
    labels. Read by the library on the host: no tensor operation, so nothing here counts as
    a read of the device."""
    bad = lib.hlat_xent_first_bad(labels.data_ptr(), labels.numel(), vocab, ignore_index)
    if bad:
        label = int(labels.reshape(-1)[bad - 1])
        raise ValueError(
            f"label {label} at position {bad - 1} is outside the vocabulary [0, {vocab}) "
            f"and is not the ignore_index ({ignore_index})"
        )


def attention_softmax(lib: ctypes.CDLL, scores: torch.Tensor, first: int) -> torch.Tensor:
    """Softmax over the last dimension of ``scores`` [blocks, rows, width] (contiguous),
    in place and returned, computed in fp32 and rounded once. With ``first >= 0`` the rows
    are causal queries at positions ``first, first + 1, ...`` against keys ``0 ..
    width - 1``: each row's softmax covers the keys up to its position, the rest are 0
    (whatever the scores held there); ``first < 0``: every key."""
    blocks, rows, width = scores.shape
    lib.hlat_attn_softmax(
        _bf16(scores), scores.data_ptr(), blocks, rows, width, first, torch.get_num_threads()
    )
    return scores


def attention_softmax_backward(
    lib: ctypes.CDLL, grad: torch.Tensor, probs: torch.Tensor, first: int
) -> torch.Tensor:
    """The gradient of :func:`attention_softmax` for its scores, ``probs * (grad -
    sum(grad * probs))`` per row, written over ``grad`` (contiguous, as ``probs``) and
    returned; ``first`` as there (keys a row does not see get 0)."""
    grad = _plain(grad)
    blocks, rows, width = grad.shape
    lib.hlat_attn_softmax_backward(
        _bf16(grad), grad.data_ptr(), probs.data_ptr(), blocks, rows, width, first,
        torch.get_num_threads(),
    )  # fmt: skip
    return grad


def add_bf16_into_fp32(lib: ctypes.CDLL, acc: torch.Tensor, x: torch.Tensor) -> None:
    """``acc += x`` for fp32 ``acc`` [batches, n...] whose batches are dense but may lie
    apart (a slice of a longer tensor) and bf16 ``x`` of the same shape, contiguous, in one
    pass (no fp32 copy of ``x``)."""
    batches = acc.shape[0]
    n = acc[0].numel()
    if not acc[0].is_contiguous() or not x.is_contiguous() or x.shape != acc.shape:
        raise ValueError("add_bf16_into_fp32 takes dense batches of the same shape")
    lib.hlat_add_bf16_into_fp32(
        acc.data_ptr(), acc.stride(0), x.data_ptr(), batches, n, torch.get_num_threads()
    )


def amx_attention_ready(lib: ctypes.CDLL) -> bool:
    """Whether the library holds the AMX attention kernels (built where the compiler
    targets AMX-BF16) and the OS lets this process use the tiles."""
    return bool(lib.hlat_attn_amx_ready())


def bf16_attention_ready(lib: ctypes.CDLL) -> bool:
    """Whether the library holds the bf16 flash attention kernels with AVX512-BF16 dot
    products (built where the compiler targets AVX512-BF16)."""
    return bool(lib.hlat_attn_bf16_ready())


def f32_attention_ready(lib: ctypes.CDLL) -> bool:
    """Whether the library holds the fp32 flash attention kernels (built where the compiler
    targets AVX-512F, or AVX2 with FMA)."""
    return bool(lib.hlat_attn_f32_ready())


def _flash_entry(
    lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, what: str, tiles: bool
) -> tuple[Any, tuple[int, int]]:
    """The flash kernel's entry point ``what`` (forward, backward) for ``q``'s dtype (fp32,
    or bf16 on AMX tiles with ``tiles`` or by dot products), and its head counts: q's and
    k's (grouped-query heads where k has fewer)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads <= 0 or heads % kv_heads != 0:
        raise ValueError(f"{heads} query heads do not share {kv_heads} key and value heads")
    if q.dtype == torch.float32:
        entry = getattr(lib, f"hlat_attn_f32_{what}")
    elif q.dtype == torch.bfloat16:
        entry = functools.partial(getattr(lib, f"hlat_attn_bf16_{what}"), int(tiles))
    else:
        raise ValueError(f"the flash attention kernels take bf16 or fp32, not {q.dtype}")
    return entry, (heads, kv_heads)


def _first_keys(first: torch.Tensor | None, batch: int, seq: int) -> int | None:
    """The address of ``first`` (each query's first key, [B, S] int64: see
    :func:`flash_attention_forward`), or None (null: plain causal attention)."""
    if first is None:
        return None
    if first.shape != (batch, seq) or first.dtype != torch.int64 or not first.is_contiguous():
        raise ValueError(
            f"first keys must be a contiguous [{batch}, {seq}] int64 tensor, got "
            f"{list(first.shape)} {first.dtype}"
        )
    # Note: the kernels index keys by these values; checked (a pass over B x S integers)
    positions = torch.arange(seq, device=first.device)
    if not (
        bool((first >= 0).all())
        and bool((first <= positions).all())
        and bool((first[:, 1:] >= first[:, :-1]).all())
    ):
        raise ValueError(
            "first keys must be document starts: at least 0, at most the query's own "
            "position, and nondecreasing along each row"
        )
    return first.data_ptr()


def flash_attention_forward(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tiles: bool = False,
    first: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of contiguous [B, H, S, D] ``q`` and [B, G, S, D] ``k``, ``v`` (S
    and D multiples of 32; G a divisor of H: grouped-query heads, each ``H / G`` query heads
    side by side reading one key and value head): bf16 on AMX tiles
    with ``tiles`` (only where :func:`amx_attention_ready`) or by AVX512-BF16 dot products
    (only where :func:`bf16_attention_ready`), fp32 on AVX-512 or AVX2 (only where
    :func:`f32_attention_ready`). With ``first`` ([B, S] int64, contiguous: the first key
    each query sees, that of its document in a packed row; nondecreasing along each row and
    at most the query's own position, as
    :func:`hlat_model.attention.document_first_keys` makes it), each query sees the keys
    from its document's first to its own, and key blocks no query of a block sees are
    skipped. Returns (the output, a [B, H, S, D] view of a [B, S, H, D] tensor; each
    query's fp32 log-sum-exp of its scaled scores [B * H, S])."""
    batch, heads, seq, dim = q.shape
    entry, head_counts = _flash_entry(lib, q, k, "forward", tiles)
    out = q.new_empty(batch, seq, heads, dim)
    lse = q.new_empty(batch * heads, seq, dtype=torch.float32)
    done = entry(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), *_row_strides(out, 1),
        lse.data_ptr(), batch, *head_counts, seq, dim, dim**-0.5,
        _first_keys(first, batch, seq), torch.get_num_threads(),
    )  # fmt: skip
    if done != 0:
        raise RuntimeError(f"the {q.dtype} flash attention kernels cannot run here")
    return out.transpose(1, 2), lse


def flash_attention_backward(
    lib: ctypes.CDLL,
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tiles: bool = False,
    first: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`flash_attention_forward` for ``q``, ``k`` and ``v`` (those of
    grouped k and v summed over each one's query heads in fp32, in bf16 rounded once), from its
    output ``out`` and ``lse`` and the output's gradient ``grad`` ([B, H, S, D], any strides
    with dense rows); ``tiles`` and ``first`` as forward's."""
    entry, head_counts = _flash_entry(lib, q, k, "backward", tiles)
    batch, _, seq, dim = q.shape
    grad = _plain(grad)
    if grad.stride(3) != 1:
        grad = grad.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
    done = entry(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), *_row_strides(out),
        grad.data_ptr(), *_row_strides(grad), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
        dv.data_ptr(), batch, *head_counts, seq, dim, dim**-0.5, _first_keys(first, batch, seq),
        torch.get_num_threads(),
    )  # fmt: skip
    if done != 0:
        raise RuntimeError(f"the {q.dtype} flash attention kernels cannot run here")
    return dq, dk, dv


def _rope_attention_table(qkv: torch.Tensor, cos: torch.Tensor) -> ctypes.Array:
    batch, seq, groups, per_group, head_dim = qkv.shape
    values = (
        batch, seq, groups, per_group - 2, head_dim, qkv.stride(0), qkv.stride(1),
        *_table_strides(cos),
    )  # fmt: skip
    return (ctypes.c_int64 * len(values))(*values)


def rope_attention_forward(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    tiles: bool = False,
    first: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the q, k and v of a bf16 ``qkv`` [B, S, G, P, D] (the fused
    product: G groups of P - 2 query heads, a key and a value head; S and D multiples of 32;
    dense over G, P and D, any strides over B and S: batch-first or sequence-first), RoPE
    applied to q and k (tables as :func:`rope_heads_forward` reads them, which
    :func:`rope_tables_usable` accepts): :func:`rope_heads_forward` and then
    :func:`flash_attention_forward` in one kernel, on AMX tiles with ``tiles`` or by dot
    products (where :func:`flash_attention_forward` runs them); ``first`` as that function's.
    Returns what :func:`flash_attention_forward` does."""
    batch, seq, groups, per_group, dim = qkv.shape
    heads = groups * (per_group - 2)
    out = qkv.new_empty(batch, seq, heads, dim)
    lse = qkv.new_empty(batch * heads, seq, dtype=torch.float32)
    done = lib.hlat_attn_bf16_rope_forward(
        int(tiles), qkv.data_ptr(), _rope_attention_table(qkv, cos), cos.data_ptr(), sin.data_ptr(),
        out.data_ptr(), *_row_strides(out, 1), lse.data_ptr(), dim**-0.5,
        _first_keys(first, batch, seq), torch.get_num_threads(),
    )  # fmt: skip
    if done != 0:
        raise RuntimeError("the bf16 flash attention kernels cannot run here")
    return out.transpose(1, 2), lse


def rope_attention_backward(
    lib: ctypes.CDLL,
    grad: torch.Tensor,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tiles: bool = False,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of :func:`rope_attention_forward` for ``qkv`` (its layout), from its
    output ``out`` and ``lse`` and the output's gradient ``grad`` ([B, H, S, D], any strides
    with dense rows): the q and k gradients rotated back, each rounded once. It has
    ``qkv``'s strides; ``tiles`` and ``first`` as forward's."""
    batch, seq, dim = qkv.shape[0], qkv.shape[1], qkv.shape[-1]
    grad = _plain(grad)
    if grad.stride(3) != 1:
        grad = grad.contiguous()
    grad_qkv = torch.empty_strided(qkv.shape, qkv.stride(), dtype=qkv.dtype)
    done = lib.hlat_attn_bf16_rope_backward(
        int(tiles), qkv.data_ptr(), _rope_attention_table(qkv, cos), cos.data_ptr(), sin.data_ptr(),
        out.data_ptr(), *_row_strides(out), grad.data_ptr(), *_row_strides(grad),
        lse.data_ptr(), grad_qkv.data_ptr(), dim**-0.5, _first_keys(first, batch, seq),
        torch.get_num_threads(),
    )  # fmt: skip
    if done != 0:
        raise RuntimeError("the bf16 flash attention kernels cannot run here")
    return grad_qkv


def _row_strides(t: torch.Tensor, seq_dim: int = 2) -> tuple[int, int, int]:
    """(batch, head, position) strides of the rows of ``t``: [B, H, S, D], or [B, S, H, D]
    with ``seq_dim`` 1."""
    if seq_dim == 1:
        return t.stride(0), t.stride(2), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)
