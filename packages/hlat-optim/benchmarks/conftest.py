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


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def _write_table(tr, title: str, header: list[str], rows: list[list[str]]) -> None:
    """A section with a table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    tr.section(title)
    for row in [header, *rows]:
        cells = [c.rjust(w) for c, w in zip(row, widths, strict=True)]
        cells[0] = row[0].ljust(widths[0])
        tr.write_line("  ".join(cells))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if HOST:
        base = HOST.get("torch fused fp32")
        rows = [[name, f"{ms:.2f}", _ratio(ms, base)] for name, ms in HOST.items()]
        _write_table(
            terminalreporter,
            "hlat-optim: AdamW step host time, 195 tensors of 64 elements",
            ["optimizer", "median ms", "vs torch fused"],
            rows,
        )
    if RESULTS:
        base = RESULTS.get("torch fused fp32", {}).get("mparam_s")
        first = next(iter(RESULTS.values()))
        rows = [
            [
                name,
                f"{r['mparam_s']:.0f}",
                _ratio(r["mparam_s"], base),
                f"{r['bytes_per_param']:.1f}",
            ]
            for name, r in RESULTS.items()
        ]
        _write_table(
            terminalreporter,
            f"hlat-optim: AdamW step, {first['params'] / 1e6:.1f}M parameters in "
            f"{first['tensors']} tensors",
            ["optimizer", "Mparam/s", "vs torch fused", "bytes/param"],
            rows,
        )
