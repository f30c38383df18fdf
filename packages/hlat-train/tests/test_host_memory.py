"""``train.host_malloc`` (``hlat_train.host_memory``): ``retain`` keeps freed host memory
mapped, so repeated large blocks stop page-faulting; ``system`` leaves glibc's defaults;
``auto`` (the default) retains in CPU runs on glibc; other values are refused before any
work."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from train_helpers import fit, tiny_config

import hlat_train.host_memory as host_memory
from hlat_parallel.device import accelerator
from hlat_train import ConfigError, Trainer
from hlat_train.host_memory import auto_host_malloc, glibc_available, resolve_host_malloc
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
    choice = resolve_host_malloc(*sys.argv[1:])
    faults()
    print(default, faults(), choice.describe())
    """
)


def _faults(asked: str, device_type: str = "cpu") -> tuple[int, int, str]:
    done = subprocess.run(
        [sys.executable, "-c", FAULTS, asked, device_type],
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
    refusal = "train.host_malloc must be 'auto', 'system' or 'retain', got 'never'"
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        validate(config, 1)
    with pytest.raises(ValueError, match="got 'never'"):
        resolve_host_malloc("never")


@pytest.mark.skipif(glibc_available(), reason="a C library other than glibc")
def test_retain_without_glibc_is_refused():
    with pytest.raises(ValueError, match="is not glibc; use 'system'"):
        resolve_host_malloc("retain")


@needs_glibc
def test_auto_retains_in_a_cpu_run():
    default, retained, choice = _faults("auto", "cpu")
    assert choice.startswith("host malloc retain: freed memory stays mapped ")
    assert choice.endswith("; auto: a CPU run on glibc")
    assert retained * 10 < default


@needs_glibc
def test_auto_keeps_glibcs_defaults_in_an_accelerator_run():
    default, unchanged, choice = _faults("auto", "cuda")
    assert choice == (
        "host malloc system: the C library's defaults; "
        "auto: the run computes on cuda, not on the host's memory"
    )
    assert unchanged > default * 0.9


@pytest.mark.parametrize(
    ("device_type", "glibc", "retain"),
    [("cpu", True, True), ("cpu", False, False), ("cuda", True, False), ("xla", True, False)],
)
def test_auto_rule(device_type, glibc, retain):
    chosen, reason = auto_host_malloc(device_type, glibc)
    assert chosen is retain
    assert reason == {
        ("cpu", True): "a CPU run on glibc",
        ("cpu", False): "the C library of this process is not glibc",
    }.get((device_type, glibc), f"the run computes on {device_type}, not on the host's memory")


def test_the_trainer_knows_its_device_type_before_any_device_is_set_up(corpus, tmp_path):
    trainer = Trainer(tiny_config(corpus, tmp_path, "--train.device=auto"))
    found = accelerator()
    assert trainer._compute_device_type() == (found.type if found is not None else "cpu")
    # what the run would compute on, read from the config alone (these devices need not exist)
    for device, backend, expected in (
        ("cpu", "torch", "cpu"),
        ("cuda:1", "torch", "cuda"),
        ("neuron", "torch", "neuron"),
        ("auto", "neuron", "xla"),
    ):
        trainer.config.train.device, trainer.config.parallel.backend = device, backend
        assert trainer._compute_device_type() == expected


def test_a_run_logs_its_choice(corpus, tmp_path, capsys):
    """A run logs its choice (``retain``, and so ``auto`` on a CPU, changes the whole process:
    the tests above take them in fresh processes)."""
    assert tiny_config(corpus, tmp_path).train.host_malloc == "auto"
    config = tiny_config(corpus, tmp_path, "--train.host_malloc=system", steps=2)
    fit(config)
    assert "host malloc system: the C library's defaults" in capsys.readouterr().err


class Glibc234Mallopt:
    """Stand-in for the C library handle (``host_memory._glibc``) of glibc 2.34 or earlier:
    its ``mallopt`` refuses ``M_MMAP_THRESHOLD`` above 32 MiB (``HEAP_MAX_SIZE / 2`` in
    malloc.c's ``do_set_mmap_threshold``) and passes every other call to this process's C
    library."""

    def __init__(self, libc):
        self.libc = libc

    def mallopt(self, option, value):
        if option.value == -3 and value.value > 32 * 2**20:  # M_MMAP_THRESHOLD
            return 0
        return self.libc.mallopt(option, value)


@pytest.fixture
def glibc_234(monkeypatch):
    real = host_memory._glibc()
    if real is None:
        pytest.skip("glibc's malloc only")
    monkeypatch.setattr(host_memory, "_glibc", lambda: Glibc234Mallopt(real))


def test_auto_keeps_the_defaults_where_glibc_refuses_the_threshold(glibc_234):
    choice = resolve_host_malloc("auto", "cpu")
    assert not choice.retain
    line = choice.describe()
    assert line.startswith("host malloc system: the C library's defaults; auto: a CPU run on ")
    assert "mallopt refused M_MMAP_THRESHOLD = 256 MiB" in line
    assert "glibc before 2.35 takes an mmap threshold of at most 32 MiB" in line


def test_retain_on_a_glibc_that_refuses_the_threshold_is_refused(glibc_234):
    with pytest.raises(ValueError, match=r"glibc before 2\.35 .*; use 'system' or 'auto'"):
        resolve_host_malloc("retain", "cpu")


def test_a_cpu_run_trains_on_a_glibc_that_refuses_the_threshold(
    glibc_234, corpus, tmp_path, capsys
):
    summary = fit(tiny_config(corpus, tmp_path, steps=2))
    assert summary["step"] == 2
    assert "host malloc system: the C library's defaults; auto: " in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"glibc before 2\.35"):
        Trainer(tiny_config(corpus, tmp_path, "--train.host_malloc=retain"))._setup()
