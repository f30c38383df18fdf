"""Host memory policy of a run: whether freed memory goes back to the OS (``train.host_malloc``).

A training step allocates the same activations, gradients and buffers every step. PyTorch's
CPU allocator takes each block from the C library's ``malloc`` and returns it with ``free``.
glibc's ``malloc`` serves large blocks from fresh ``mmap`` regions (above its adaptive mmap
threshold, at most 32 MiB) and returns the top of its heap to the OS whenever more than its
trim threshold is free, so the next step touches the same amount of memory in new pages,
one page fault per 4 KiB. With ``retain``, blocks up to :data:`MMAP_THRESHOLD_BYTES` come
from the heap and up to :data:`TRIM_THRESHOLD_BYTES` of free heap stays with the process,
so later steps reuse pages already mapped. PyTorch's own CPU launcher
(``python -m torch.backends.xeon.run_cpu``) reaches the same end by preloading jemalloc or
tcmalloc configured never to return memory; this needs no other allocator, since glibc's
``mallopt`` sets both thresholds at run time.

``auto`` (the default) is ``retain`` where the run computes on the CPU and the C library is
glibc, and the C library's defaults elsewhere (an accelerator's step allocates device memory,
not the host's). glibc before 2.35 refuses an mmap threshold above 32 MiB (half its
``HEAP_MAX_SIZE``); there ``auto`` keeps the defaults and logs why, and ``retain`` is refused.

Note: on a 2-core AVX512-BF16 CPU, a bf16 forward + backward of the benchmarks' Llama
shape (width 512, 8 layers, 4 x 512 tokens) page-faulted 32k-62k times per step with glibc's
defaults and at most 2.2k times with ``retain``, and ran 1.02x faster (fastest step of five
rounds; ``retain`` won four: ``benchmarks/test_bench_host_malloc.py``); whole ``hlat-train``
runs in four alternating pairs gave 0.91x to 1.24x, while runs with the defaults alone spread
by 24 % on that machine. On a 2-core Xeon with AMX, whose products take a smaller share of
the step, the same benchmark gave 1.042x (22k-42k faults per step against 173-686;
``retain`` won five rounds of five) and whole runs 1.011x to 1.088x (four pairs of four). So
CPU runs retain by default. The price is resident memory: the process keeps up to the trim
threshold of free heap, and its largest step's blocks, mapped between steps; ``system``
gives it back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
from dataclasses import dataclass
from typing import Any

MMAP_THRESHOLD_BYTES = 256 * 2**20
"""Blocks below this size come from the heap (glibc's default adapts up to 32 MiB)."""
TRIM_THRESHOLD_BYTES = 2**30
"""Free memory at the top of the heap that stays with the process (glibc's default adapts
to twice the mmap threshold)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>

CHOICES = ("auto", "system", "retain")


@dataclass(frozen=True)
class HostMallocChoice:
    """What ``train.host_malloc`` applied: ``retain`` or the C library's defaults, and why
    where ``auto`` chose."""

    retain: bool
    auto_reason: str = ""

    def describe(self) -> str:
        """The log line of the choice."""
        if self.retain:
            line = (
                "host malloc retain: freed memory stays mapped (glibc's mmap threshold "
                f"{MMAP_THRESHOLD_BYTES >> 20} MiB, trim threshold {TRIM_THRESHOLD_BYTES >> 20} MiB)"
            )
        else:
            line = "host malloc system: the C library's defaults"
        return f"{line}; auto: {self.auto_reason}" if self.auto_reason else line


def auto_host_malloc(device_type: str, glibc: bool) -> tuple[bool, str]:
    """What ``auto`` picks for a run computing on ``device_type`` (``retain``: True), and
    why."""
    if device_type != "cpu":
        return False, f"the run computes on {device_type}, not on the host's memory"
    if not glibc:
        return False, "the C library of this process is not glibc"
    return True, "a CPU run on glibc"


@functools.cache
def _glibc() -> Any | None:
    """glibc's C library, or None where the process runs on another one (musl, macOS,
    Windows)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def glibc_available() -> bool:
    """Whether this process's C library is glibc, whose thresholds ``retain`` sets."""
    return _glibc() is not None


def _glibc_version() -> str:
    """``glibc 2.31`` and the like, or ``glibc`` where the version is not known."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or "glibc"
    except (AttributeError, ValueError, OSError):
        return "glibc"


class MalloptRefused(RuntimeError):
    """glibc's ``mallopt`` refused a threshold (glibc before 2.35 caps the mmap threshold)."""


def retain_freed_memory() -> None:
    """Raise glibc's mmap and trim thresholds (:data:`MMAP_THRESHOLD_BYTES`,
    :data:`TRIM_THRESHOLD_BYTES`) for the whole process, from now on.

    Raises ``RuntimeError`` where the C library is not glibc, and :class:`MalloptRefused`
    where it refuses a value (nothing is changed where it refuses the mmap threshold)."""
    libc = _glibc()
    if libc is None:
        raise RuntimeError("the C library of this process is not glibc")
    for option, name, value in (
        (_M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD", MMAP_THRESHOLD_BYTES),
        (_M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", TRIM_THRESHOLD_BYTES),
    ):
        if libc.mallopt(ctypes.c_int(option), ctypes.c_int(value)) != 1:
            raise MalloptRefused(
                f"{_glibc_version()}'s mallopt refused {name} = {value >> 20} MiB "
                "(glibc before 2.35 takes an mmap threshold of at most 32 MiB)"
            )


def resolve_host_malloc(asked: str, device_type: str = "cpu") -> HostMallocChoice:
    """What ``train.host_malloc = asked`` means for a run computing on ``device_type``,
    applied: ``system`` leaves the C library's defaults untouched; ``retain`` calls
    :func:`retain_freed_memory` (a ``ValueError`` naming the reason where it cannot: a C
    library other than glibc, or a glibc before 2.35); ``auto`` is :func:`auto_host_malloc`'s
    choice, and the defaults where glibc refuses the thresholds."""
    if asked not in CHOICES:
        raise ValueError(f"train.host_malloc must be 'auto', 'system' or 'retain', got {asked!r}")
    reason = ""
    explicit = asked == "retain"
    if asked == "auto":
        retain, reason = auto_host_malloc(device_type, glibc_available())
        asked = "retain" if retain else "system"
    if asked == "system":
        return HostMallocChoice(retain=False, auto_reason=reason)
    try:
        retain_freed_memory()
    except MalloptRefused as error:
        if not explicit:
            return HostMallocChoice(retain=False, auto_reason=f"a CPU run on glibc, but {error}")
        raise ValueError(
            f"train.host_malloc = 'retain' sets glibc's malloc thresholds, and here {error}; "
            "use 'system' or 'auto' on glibc < 2.35"
        ) from None
    except RuntimeError as error:
        raise ValueError(
            f"train.host_malloc = 'retain' sets glibc's malloc thresholds, and here {error}; "
            "use 'system'"
        ) from None
    return HostMallocChoice(retain=True, auto_reason=reason)
