"""``train.host_malloc`` (``hlat_train.host_memory``): ``retain`` keeps freed host memory
mapped, so repeated large blocks stop page-faulting; ``system`` (the default) leaves glibc's
defaults; other values are refused before any work."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from train_helpers import fit, tiny_config

from hlat_train import ConfigError
from hlat_train.host_memory import glibc_available, resolve_host_malloc
from hlat_train.validation import validate

needs_glibc = pytest.mark.skipif(not glibc_available(), reason="glibc's malloc only")

# A fresh process counts its minor page faults over 10 allocations of a 64 MiB tensor, each
# written and freed, before and after resolving train.host_malloc (process-wide settings).
FAULTS = textwrap.dedent(
    """
    import resource, sys, torch
    from hlat_train.host_memory import resolve_host_malloc

    def faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            block = torch.empty(16 * 2**20)  # 64 MiB of fp32
            block.fill_(1.0)
            del block
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults()  # the first pass maps what any later one may reuse
    default = faults()
    choice = resolve_host_malloc(sys.argv[1])
    faults()
    print(default, faults(), choice.describe())
    """
)


def _faults(asked: str) -> tuple[int, int, str]:
    done = subprocess.run(
        [sys.executable, "-c", FAULTS, asked],
        capture_output=True,
        text=True,
        check=True,
    )
    default, after, described = done.stdout.split(maxsplit=2)
    return int(default), int(after), described.strip()


@needs_glibc
def test_retain_stops_large_blocks_from_page_faulting_each_time():
    default, retained, choice = _faults("retain")
    assert choice == (
        "host malloc retain: freed memory stays mapped "
        "(glibc's mmap threshold 256 MiB, trim threshold 1024 MiB)"
    )
    # glibc's defaults map every 64 MiB block afresh: 16,384 pages, each faulted in
    assert default >= 10 * 16384 * 0.9
    assert retained * 10 < default


@needs_glibc
def test_system_leaves_glibcs_defaults():
    default, unchanged, choice = _faults("system")
    assert choice == "host malloc system: the C library's defaults"
    assert unchanged > default * 0.9


def test_other_values_are_refused_before_any_work(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path, "--train.host_malloc=never")
    refusal = "train.host_malloc must be 'system' or 'retain', got 'never'"
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        validate(config, 1)
    with pytest.raises(ValueError, match="got 'never'"):
        resolve_host_malloc("never")


@pytest.mark.skipif(glibc_available(), reason="a C library other than glibc")
def test_retain_without_glibc_is_refused():
    with pytest.raises(ValueError, match="is not glibc; use 'system'"):
        resolve_host_malloc("retain")


def test_a_run_logs_its_choice(corpus, tmp_path, capsys):
    """The default keeps glibc's and says so (``retain`` changes the whole process, so the
    tests above ask for it in fresh processes)."""
    config = tiny_config(corpus, tmp_path, steps=2)
    assert config.train.host_malloc == "system"
    fit(config)
    assert "host malloc system: the C library's defaults" in capsys.readouterr().err
