"""Builds and loads the CPU AdamW kernel (``_adamw_cpu.cpp``) on first use.

The kernel is compiled once per machine type with the host C++ compiler (``$CXX``, else
``c++``, ``g++`` or ``clang++``) into a cache directory (``$HLAT_OPTIM_CACHE_DIR``, else
``$XDG_CACHE_HOME/hlat-optim`` or ``~/.cache/hlat-optim``) and called through ctypes, which
needs neither torch's headers nor a build step at install time: the same requirement as
``torch.compile`` on CPU, which compiles C++ at run time too. The cache key covers the
source, the flags, the compiler and the CPU's feature flags, so a shared home directory on a
cluster of mixed machines never loads a library built for another CPU. If no compiler works,
``load()`` returns ``None`` and says why in ``unavailable_reason()``.

``$HLAT_OPTIM_CXXFLAGS`` adds flags after the defaults, e.g. ``-march=x86-64-v3`` to build
for the oldest CPU of a mixed cluster, or ``-mno-avx512f`` for the 8-lane loop on an
AVX-512 CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["cache_dir", "load", "unavailable_reason"]

_SOURCE = Path(__file__).with_name("_adamw_cpu.cpp")
_ABI = 5
# -ffp-contract=off: no FMA contraction, so every result is the reference's bit for bit.
_FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-std=c++17",
    "-shared",
    "-fPIC",
]
# Tried in order: with OpenMP (the update splits over torch's threads), then without (one
# thread; e.g. Apple clang, which has no -fopenmp).
_VARIANTS: tuple[list[str], ...] = (["-fopenmp"], [])

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_tried = False


def cache_dir() -> Path:
    """Where built kernels are kept."""
    env = os.environ.get("HLAT_OPTIM_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hlat-optim"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    errors = []
    user_flags = shlex.split(os.environ.get("HLAT_OPTIM_CXXFLAGS", ""))
    for extra in _VARIANTS:
        try:
            return _build_with(compiler, [*_FLAGS, *user_flags, *extra])
        except RuntimeError as exc:
            errors.append(str(exc))
    raise RuntimeError("; ".join(errors))


def _build_with(compiler: str, flags: list[str]) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    source = _SOURCE.read_bytes()
    key = hashlib.sha256()
    for part in (source, " ".join(flags).encode(), version.encode(), _cpu_features().encode()):
        key.update(part)
        key.update(b"\0")
    target = cache_dir() / f"adamw_cpu_{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a unique name and rename: ranks that start together may all build.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *flags, str(_SOURCE), "-o", tmp],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{compiler} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _bind(path: Path) -> ctypes.CDLL:
    # Note: torch is imported before this runs, so the OpenMP runtime the library needs
    # (libgomp.so.1) resolves to the one torch already loaded: one thread pool, not two.
    lib = ctypes.CDLL(str(path))
    if lib.hlat_adamw_abi() != _ABI:
        raise RuntimeError(f"{path} has another entry-point version than this hlat-optim")
    fn = lib.hlat_adamw_step
    fn.restype = ctypes.c_int64
    fn.argtypes = [
        ctypes.c_int64,  # number of tensors
        ctypes.c_void_p,  # table: 10 int64 per tensor
        ctypes.c_void_p,  # hyperparameters: 7 float32 per tensor
        ctypes.c_int,  # threads
        ctypes.c_void_p,  # skip flag: one torch.bool, or null
        ctypes.c_void_p,  # the gradients' multiplier: one float32, or null
    ]
    sumsq = lib.hlat_bf16_row_sumsq
    sumsq.restype = None
    sumsq.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    return lib


def bf16_row_sums_of_squares(lib: ctypes.CDLL, rows: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of squares of each row of a contiguous 2-d bf16 CPU tensor, in one read
    of it (fixed order: the same for any thread count)."""
    count, length = rows.shape
    sums = torch.empty(count, dtype=torch.float32)
    lib.hlat_bf16_row_sumsq(
        rows.data_ptr(), count, length, sums.data_ptr(), torch.get_num_threads()
    )
    return sums


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; ``None`` if it cannot be built here."""
    global _lib, _reason, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("HLAT_OPTIM_NATIVE", "1") == "0":
            _reason = "disabled by HLAT_OPTIM_NATIVE=0"
            return None
        compiler = _compiler()
        if compiler is None:
            _reason = "no C++ compiler found (set CXX)"
            return None
        try:
            _lib = _bind(_build(compiler))
        except Exception as exc:
            _reason = f"{type(exc).__name__}: {exc}"
            _lib = None
        return _lib


def unavailable_reason() -> str | None:
    """Why ``load()`` returned ``None`` (after it was called), else ``None``."""
    return _reason
