"""Prints the optimizer benchmark as a table of throughput ratios and bytes per parameter."""

from __future__ import annotations

import pytest

RESULTS: dict[str, dict[str, float]] = {}


@pytest.fixture(scope="session")
def optimizer_results() -> dict[str, dict[str, float]]:
    """Filled by each benchmark, printed at the end of the run."""
    return RESULTS


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not RESULTS:
        return
    base = RESULTS.get("torch fused fp32", {}).get("mparam_s")
    tr = terminalreporter
    tr.section("hlat-optim: AdamW step, ~50M parameters")
    tr.write_line(f"{'optimizer':<34} {'Mparam/s':>9} {'vs torch fused':>15} {'bytes/param':>12}")
    for name, r in RESULTS.items():
        ratio = f"{r['mparam_s'] / base:.2f}x" if base else "-"
        tr.write_line(f"{name:<34} {r['mparam_s']:>9.0f} {ratio:>15} {r['bytes_per_param']:>12.1f}")
