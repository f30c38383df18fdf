"""Prints the tensor- and pipeline-parallel comparison tables at the end of the benchmark run."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

RESULTS: dict[str, dict] = {}
PP_RESULTS: dict[int, dict] = {}


@pytest.fixture(scope="session")
def tp_results() -> dict[str, dict]:
    """Filled by each throughput run, printed at the end of the session."""
    return RESULTS


@pytest.fixture(scope="session")
def pp_results() -> dict[int, dict]:
    """Filled by the pipeline benchmark (micro-batches -> table), printed at the end."""
    return PP_RESULTS


def cpu_kind() -> str:
    """The CPU model, its widest vector instructions and the core count, for every figure."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.*)", text)
    found = re.search(r"flags\s*:\s*(.*)", text)
    flags = set(found.group(1).split()) if found else set()
    if "avx512f" in flags:
        isa = "AVX-512" + (" with BF16" if "avx512_bf16" in flags else "")
    else:
        isa = "AVX2 only" if "avx2" in flags else "no AVX2"
    return f"{model.group(1) if model else 'unknown CPU'}, {isa}, {os.cpu_count()} cores"


@pytest.fixture(scope="session")
def cpu() -> str:
    return cpu_kind()


def pipeline_summary_lines() -> list[str]:

    lines = [f"hlat-parallel pipeline benchmark, PP2 on 2 processes; {cpu_kind()}"]
    for m, table in PP_RESULTS.items():
        lines.append(f"m = {m} micro-batches")
        lines.append(f"  {'schedule':<22} {'bubble theory':>13} {'measured':>9} {'tokens/s':>9}")
        for name, row in table.items():
            if "theory" in row:
                lines.append(
                    f"  {name:<22} {row['theory']:>13.3f} {row['measured']:>9.3f} "
                    f"{row['tokens_per_s']:>9.0f}"
                )
        pp2 = table["1F1B"]["tokens_per_s"]
        dp2, one = table["DP2"]["tokens_per_s"], table["single"]["tokens_per_s"]
        lines.append(
            f"  tokens/s: PP2 (1F1B) {pp2:.0f}, DP2 {dp2:.0f}, one process {one:.0f}; "
            f"PP2/DP2 {pp2 / dp2:.2f}x, PP2/one {pp2 / one:.2f}x, DP2/one {dp2 / one:.2f}x"
        )
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if PP_RESULTS:
        terminalreporter.section("hlat-parallel: pipeline schedules")
        for line in pipeline_summary_lines():
            terminalreporter.write_line(line)
    if not {"tp1", "tp2", "tp2-sp"} <= set(RESULTS):
        return
    tr = terminalreporter
    base = RESULTS["tp1"]["tokens_per_s"]
    c = RESULTS["tp2-sp"]["config"]
    tr.section(f"hlat-parallel: tiny Llama, batch {c['batch']} x {c['seq']} tokens, fp32, CPU")
    tr.write_line(f"{'layout':<12} {'tokens/s':>9} {'vs tp1':>7} {'MB sent/rank/step':>18}")
    for name, r in RESULTS.items():
        sent = sum(r["bytes_per_rank"].values()) / 1e6
        ratio = r["tokens_per_s"] / base
        tr.write_line(f"{name:<12} {r['tokens_per_s']:>9.0f} {ratio:>6.2f}x {sent:>18.2f}")
    measured = RESULTS["tp2-sp"]
    analytic = measured["analytic"]
    tr.write_line("")
    tr.write_line(
        f"{'tp2-sp collective':<18} {'calls':>6} {'MB/rank':>9} {'Megatron':>9} {'ratio':>6}"
    )
    for kind in sorted(set(measured["bytes_per_rank"]) | set(analytic)):
        got = measured["bytes_per_rank"].get(kind, 0.0) / 1e6
        want = analytic.get(kind, 0.0) / 1e6
        ratio = f"{got / want:.3f}" if want else "-"
        calls = measured["counts"].get(kind, 0)
        tr.write_line(f"{kind:<18} {calls:>6} {got:>9.3f} {want:>9.3f} {ratio:>6}")
