"""Prints the tensor-parallel throughput comparison table at the end of the benchmark run."""

from __future__ import annotations

import pytest

RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="session")
def tp_results() -> dict[str, dict]:
    """Filled by each throughput run, printed at the end of the session."""
    return RESULTS


def pytest_terminal_summary(terminalreporter, exitstatus, config):
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
