"""Prints the optimizer benchmarks as tables: throughput ratios and bytes per parameter, and
the host time of a step of many small tensors."""

from __future__ import annotations

import pytest

RESULTS: dict[str, dict[str, float]] = {}
HOST: dict[str, float] = {}  # median ms per step of 195 small tensors


@pytest.fixture(scope="session")
def optimizer_results() -> dict[str, dict[str, float]]:
    """Filled by each benchmark, printed at the end of the run."""
    return RESULTS


@pytest.fixture(scope="session")
def host_results() -> dict[str, float]:
    """Filled by the host-time benchmark, printed at the end of the run."""
    return HOST


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if HOST:
        base = HOST.get("torch fused fp32")
        tr = terminalreporter
        tr.section("hlat-optim: AdamW step host time, 195 tensors of 64 elements")
        tr.write_line(f"{'optimizer':<38} {'median ms':>10} {'vs torch fused':>15}")
        for name, ms in HOST.items():
            ratio = f"{ms / base:.2f}x" if base else "-"
            tr.write_line(f"{name:<38} {ms:>10.2f} {ratio:>15}")
    if not RESULTS:
        return
    base = RESULTS.get("torch fused fp32", {}).get("mparam_s")
    tr = terminalreporter
    tr.section("hlat-optim: AdamW step, ~50M parameters")
    tr.write_line(f"{'optimizer':<34} {'Mparam/s':>9} {'vs torch fused':>15} {'bytes/param':>12}")
    for name, r in RESULTS.items():
        ratio = f"{r['mparam_s'] / base:.2f}x" if base else "-"
        tr.write_line(f"{name:<34} {r['mparam_s']:>9.0f} {ratio:>15} {r['bytes_per_param']:>12.1f}")
