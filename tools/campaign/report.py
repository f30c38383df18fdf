"""The campaign's report: ``docs/reliability.md`` rendered from a summary (the dict that
``summary.json`` holds) and the timeline plot.

The prose and the table layouts live in ``report.md`` next to this file, as sections of
``string.Template`` text (see its opening comment); the functions here only compute and
format the values that fill the ``${name}`` placeholders, and choose the optional
paragraphs (hangs, NaN losses, the before/after table).
"""

from __future__ import annotations

import math
import re
from functools import cache
from pathlib import Path
from string import Template
from typing import Any

from .harness import Fault
from .measure import HLAT_7B_BYTES_PER_PARAM, HLAT_7B_PARAMS, HLAT_NODES, median_restart_latency

TEMPLATES = Path(__file__).with_name("report.md")
_SECTION = re.compile(r"^<!-- ([a-z][a-z-]*) -->$", re.MULTILINE)


@cache
def templates() -> dict[str, Template]:
    """The sections of ``report.md`` by name, blank lines at their ends dropped."""
    parts = _SECTION.split(TEMPLATES.read_text())
    return {
        name: Template(body.strip("\n"))
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def _fill(name: str, **values: Any) -> str:
    return templates()[name].substitute(values)


def plot_timeline(
    records: list[dict[str, Any]], faults: list[Fault], ref: dict[str, Any], path: Path
) -> bool:
    """Steps against wall time, faults marked, the uninterrupted run for comparison."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.plot(
        [r["_t"] for r in ref["records"]],
        [r["step"] for r in ref["records"]],
        color="0.6",
        lw=1,
        label="uninterrupted run",
    )
    ax.plot(
        [r["_t"] for r in records],
        [r["step"] for r in records],
        ".",
        ms=2,
        color="tab:blue",
        label="campaign: logged steps",
    )
    colors = {
        "kill-rank": "tab:red",
        "kill-during-save": "tab:purple",
        "sigterm": "tab:orange",
        "corrupt-newest": "tab:brown",
        "hang-rank": "tab:green",
        "nan": "tab:olive",
    }
    seen: set[str] = set()
    for f in faults:
        if math.isnan(f.at):
            continue
        ax.axvline(
            f.at,
            color=colors[f.kind],
            ls="--",
            lw=1,
            label=None if f.kind in seen else f.kind,
        )
        seen.add(f.kind)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("step")
    ax.set_title("fault campaign: steps against wall time")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _before_after(after: dict[str, Any], before: dict[str, Any]) -> str:
    """A Markdown table of the measured terms of an earlier run (``before``) and this one."""

    def cells(prefix: str, s: dict[str, Any]) -> dict[str, str]:
        c, st, p = s["campaign"], s["stall"], s["projection_hlat_7b"]
        small, large = st["rows"][0], st["rows"][-1]
        imports = s["startup"].get("import hlat-train and its packages", math.nan)
        cells = {
            "restart": f"{c['restart_latency_median_s']:.2f} s ({c['restart_latency_max_s']:.2f} s)",
            "lost_work": f"{c['lost_work_mean_s']:.2f} s",
            "imports": f"{imports:.2f} s",
            "import_torch": f"{s['startup'].get('import torch', math.nan):.2f} s",
            "stall_small": f"{small['async_s'] * 1e3:.1f} ms = {small['async_s'] / small['sync_s']:.1%}",
            "stall_large": f"{large['async_s'] * 1e3:.1f} ms = {large['async_s'] / large['sync_s']:.1%}",
            "async_fixed": f"{st['async_fixed_s'] * 1e3:.1f} ms",
            "utilisation": f"{c['utilisation']:.1%}",
            "projected": f"{p['utilisation']:.2%}",
        }
        return {f"{prefix}_{k}": v for k, v in cells.items()}

    return _fill(
        "before-after",
        command=before["command"],
        versions=before.get("versions", "hlat 0.1"),
        small_mb=f"{after['stall']['rows'][0]['state_bytes_per_rank'] / 1e6:.1f}",
        large_mb=f"{after['stall']['rows'][-1]['state_bytes_per_rank'] / 1e6:.1f}",
        **cells("b", before),
        **cells("a", after),
    )


def _hang_and_nan_text(s: dict[str, Any]) -> str:
    """The paragraphs on the ``hang-rank`` and ``nan`` faults of a summary, each after a
    blank line (empty without either)."""
    c = s["campaign"]
    text = ""
    hang = c.get("hang_detection_latency_median_s", math.nan)
    if not math.isnan(hang):
        text += "\n" + _fill(
            "hangs",
            hang_timeout=f"{c['hang_timeout_s']:g}",
            median_s=f"{hang:.2f}",
            max_s=f"{c['hang_detection_latency_max_s']:.2f}",
        )
        text += "\n"
    if c.get("nan_caught"):
        text += "\n" + _fill(
            "nans", nan_steps=", ".join(map(str, c["nan_steps"])), nan_caught=c["nan_caught"]
        )
        text += "\n"
    return text


def render(summary: dict[str, Any], command: str, before: dict[str, Any] | None = None) -> str:
    """The text of docs/reliability.md: the measured tables and the projection; with
    ``before`` (the summary of an earlier run) also a table of the measured terms before and
    after."""
    s = summary
    c = s["campaign"]
    st = s["stall"]
    p = s["projection_hlat_7b"]
    ref = s["reference"]
    final = s["final"]
    fault_rows = "\n".join(
        _fill(
            "fault-row",
            n=i + 1,
            kind=f["kind"],
            at=f"{f['at']:.1f}",
            step_at_fault=f["step_at_fault"],
            resumed_from=f["resumed_from"],
            to_resumed_s=f"{f['to_resumed_s']:.2f}",
            restart_latency_s=f"{f['restart_latency_s']:.2f}",
            lost_work_s=f"{f['lost_work_s']:.2f}",
            lost_steps=f["lost_steps"],
        )
        for i, f in enumerate(s["faults"])
        if not math.isnan(f["at"])
    )
    stall_rows = "\n".join(
        _fill(
            "stall-row",
            state_mb=f"{r['state_bytes_per_rank'] / 1e6:.1f}",
            sync_ms=f"{r['sync_s'] * 1e3:.1f}",
            async_ms=f"{r['async_s'] * 1e3:.1f}",
            async_over_sync=f"{r['async_s'] / r['sync_s']:.1%}",
        )
        for r in st["rows"]
    )
    startup_rows = "\n".join(
        _fill("startup-row", piece=k, seconds=f"{v:.2f}") for k, v in s["startup"].items()
    )
    cs = c["checkpoint_saves"]
    in_run = (
        _fill(
            "in-run",
            saves=cs["saves"],
            state_mb=f"{cs['bytes'] / 1e6:.1f}",
            stall_ms=f"{cs['stall_median_s'] * 1e3:.1f}",
            write_ms=f"{cs['write_median_s'] * 1e3:.1f}",
        )
        if cs["saves"]
        else _fill("in-run-none")
    )
    large = st["rows"][-1]
    sync_rate = large["state_bytes_per_rank"] / large["sync_s"]
    text = _fill(
        "report",
        command=command,
        max_restarts=len(s["faults"]) + 2,
        steps=s["setup"]["steps"],
        model=s["setup"]["model"],
        checkpoint_every=s["setup"]["checkpoint_every"],
        faults_injected=c["faults_injected"],
        seed=s["setup"]["seed"],
        mean_gap_steps=f"{s['setup']['mean_gap_steps']:.0f}",
        wall_s=f"{c['wall_s']:.1f}",
        ref_wall_s=f"{ref['wall_s']:.1f}",
        productive_s=f"{c['productive_s']:.1f}",
        ref_productive_s=f"{ref['productive_s']:.1f}",
        utilisation=f"{c['utilisation']:.1%}",
        ref_utilisation=f"{ref['utilisation']:.1%}",
        kinds=", ".join(f"{k} {v}" for k, v in c["kinds"].items()),
        mtbf_s=f"{c['mtbf_s']:.1f}",
        restart_median_s=f"{c['restart_latency_median_s']:.2f}",
        restart_max_s=f"{c['restart_latency_max_s']:.2f}",
        lost_work_mean_s=f"{c['lost_work_mean_s']:.2f}",
        bit_identical="yes" if final["bit_identical"] else "NO",
        tensors_compared=final["tensors_compared"],
        loss_trajectory_identical="yes" if final["loss_trajectory_identical"] else "no",
        mtbf_s_whole=f"{c['mtbf_s']:.0f}",
        ref_wall_s_whole=f"{ref['wall_s']:.0f}",
        fault_rows=fault_rows,
        robustness=_hang_and_nan_text(s),
        startup_rows=startup_rows,
        stall_rows=stall_rows,
        in_run=in_run,
        async_fixed_ms=f"{st['async_fixed_s'] * 1e3:.1f}",
        staging_gb_s=f"{st['staging_bandwidth_gb_s']:.2f}",
        staging_gb_s_short=f"{st['staging_bandwidth_gb_s']:.1f}",
        async_over_sync=", ".join(f"{x:.1%}" for x in st["async_over_sync"]),
        target_met="met" if max(st["async_over_sync"]) < 0.10 else "NOT met",
        p_restart_latency_s=f"{p['restart_latency_s']:.2f}",
        hlat_7b_state_gb=f"{HLAT_7B_PARAMS * HLAT_7B_BYTES_PER_PARAM / 1e9:.1f}",
        hlat_nodes=HLAT_NODES,
        state_gb_per_node=f"{p['state_bytes_per_node'] / 1e9:.2f}",
        p_stall_s=f"{p['stall_s']:.2f}",
        p_interval_s=f"{p['interval_s']:.0f}",
        p_expected_lost_work_s=f"{p['expected_lost_work_s']:.0f}",
        p_stall_share=f"{p['stall_s'] / p['interval_s']:.3%}",
        p_fault_share=f"{(p['restart_latency_s'] + p['expected_lost_work_s']) / p['mtbf_s']:.3%}",
        p_utilisation=f"{p['utilisation']:.2%}",
        one_node_utilisation=f"{s['projection_hlat_7b_one_node']['utilisation']:.2%}",
        sync_gb_s=f"{sync_rate / 1e9:.2f}",
        node_write_s=f"{p['state_bytes_per_node'] / sync_rate:.1f}",
        crash_restart_median_s=f"{median_restart_latency(s['faults'], ('kill-rank', 'kill-during-save')):.1f}",
        imports_s=f"{s['startup'].get('import hlat-train and its packages', math.nan):.1f}",
        import_torch_s=f"{s['startup'].get('import torch', math.nan):.1f}",
        before_after="\n" + _before_after(s, before) + "\n" if before else "",
        corrupt=s["setup"].get("corrupt", "manifest"),
    )
    return text + "\n"


def write_doc(
    summary: dict[str, Any], path: Path, command: str, before: dict[str, Any] | None = None
) -> None:
    """Write ``render(summary, command, before)`` to ``path`` (docs/reliability.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(summary, command, before))
