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
from .measure import median_restart_latency

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


def companion_of(other: dict[str, Any]) -> dict[str, Any]:
    """What the report shows of another campaign (another precision): its command, faults
    and final comparison."""
    c, final = other["campaign"], other["final"]
    return {
        "precision": other["setup"].get("precision", "fp32"),
        "command": other["command"],
        "faults": c["faults_injected"],
        "kinds": ", ".join(f"{k} {v}" for k, v in c["kinds"].items()),
        "bit_identical": final["bit_identical"],
        "tensors": final["tensors_compared"],
        "trajectory": final["loss_trajectory_identical"],
        "restart_s": c["restart_latency_median_s"],
        "utilisation": c["utilisation"],
    }


def _companion_text(s: dict[str, Any]) -> str:
    """The paragraph on the companion campaign (``--companion``), after a blank line; empty
    without one."""
    c = s.get("companion")
    if not c:
        return ""
    return (
        "\n"
        + _fill(
            "companion",
            c_precision=c["precision"],
            c_command=c["command"],
            c_faults=c["faults"],
            c_kinds=c["kinds"],
            c_bit_identical="yes" if c["bit_identical"] else "NO",
            c_tensors=c["tensors"],
            c_trajectory="yes" if c["trajectory"] else "no",
            c_restart_s=f"{c['restart_s']:.2f}",
            c_utilisation=f"{c['utilisation']:.1%}",
        )
        + "\n"
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
            shape=_shape(r),
            write_ms=f"{r['async_write_s'] * 1e3:.1f}" if "async_write_s" in r else "-",
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
        **_projection_values(p, st),
        crash_restart_median_s=f"{median_restart_latency(s['faults'], ('kill-rank', 'kill-during-save')):.1f}",
        imports_s=f"{s['startup'].get('import hlat-train and its packages', math.nan):.1f}",
        import_torch_s=f"{s['startup'].get('import torch', math.nan):.1f}",
        before_after="\n" + _before_after(s, before) + "\n" if before else "",
        corrupt=s["setup"].get("corrupt", "manifest"),
        precision=s["setup"].get("precision", "fp32"),
        companion=_companion_text(s),
    )
    return text + "\n"


def _shape(row: dict[str, Any]) -> str:
    """A stall row's model: ``hlat_model.Llama dim x layers`` (or an older summary's
    ``nn.Sequential`` width)."""
    if "shape" in row:
        dim, layers = row["shape"].split("x")
        return f"Llama {dim} x {layers} layers ({row['params'] / 1e6:.0f} M parameters)"
    return f"4 x Linear({row['width']}, {row['width']})"


def _projection_values(p: dict[str, Any], st: dict[str, Any]) -> dict[str, str]:
    """The projection section's values."""
    assumed_rows = "\n".join(
        _fill("assumed-row", what=what, seconds=f"{seconds:.0f}", source=source)
        for what, seconds, source in p["restart_assumed"]
    )
    return {
        "every": str(p["every"]),
        "mtbf_hours": f"{p['mtbf_hours']:g}",
        "state_gb": f"{p['state_bytes'] / 1e9:.1f}",
        "state_gb_per_node": f"{p['state_bytes_per_node'] / 1e9:.2f}",
        "stall_model": st.get("model", "4 x nn.Linear with torch's AdamW"),
        "p_stall_s": f"{p['stall_s']:.2f}",
        "p_write_s": f"{p['write_s']:.1f}",
        "write_gb_s": f"{st['write_gb_s']:.2f}",
        "load_gb_s": f"{st['load_gb_s']:.2f}",
        "p_restart_measured_s": f"{p['restart_measured_s']:.1f}",
        "p_restart_load_s": f"{p['restart_load_s']:.1f}",
        "assumed_rows": assumed_rows,
        "p_restart_total_s": f"{p['restart_total_s']:.0f}",
        "llama3_mtbf_h": f"{p['llama3_mtbf_at_2048_h']:.0f}",
        "p_interval_s": f"{p['interval_s']:.0f}",
        "p_interval_min": f"{p['interval_s'] / 60:.1f}",
        "p_expected_lost_work_s": f"{p['expected_lost_work_s']:.0f}",
        "p_utilisation": f"{p['utilisation']:.2%}",
        "p_utilisation_measured_only": f"{p['utilisation_measured_restart_only']:.2%}",
        "p_utilisation_fixed_1000": f"{p['utilisation_fixed_1000_steps']:.2%}",
        "fixed_1000_min": f"{p['fixed_1000_steps_s'] / 60:.0f}",
        "zero1_every_rank_gb": f"{p['zero1_every_rank_bytes_per_node'] / 1e9:.1f}",
    }


def plot_sensitivity(summary: dict[str, Any], path: Path) -> None:
    """Utilisation against the MTBF and against the checkpoint interval
    (``summary["projection_hlat_7b"]["sensitivity"]``) as a two-panel PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = summary["projection_hlat_7b"]
    sens = p["sensitivity"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(sens["mtbf_hours"], [100 * u for u in sens["auto"]], label="auto interval")
    left.plot(
        sens["mtbf_hours"],
        [100 * u for u in sens["fixed_1000_steps"]],
        label=f"every 1000 steps ({p['fixed_1000_steps_s'] / 60:.0f} min)",
    )
    left.axhline(98.81, color="grey", linestyle=":", label="HLAT, 98.81 %")
    left.set_xlabel("MTBF (hours)")
    left.set_ylabel("projected utilisation (%)")
    left.set_title("hlat-7b, 64 trn1 nodes")
    left.legend(fontsize=8)
    minutes = [i / 60 for i in sens["interval_s"]]
    right.plot(minutes, [100 * u for u in sens["at_interval"]], marker="o")
    right.axvline(p["interval_s"] / 60, color="grey", linestyle=":", label="auto")
    right.set_xscale("log")
    right.set_xlabel("checkpoint interval (minutes)")
    right.set_title(f"MTBF {p['mtbf_hours']:g} h")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_doc(
    summary: dict[str, Any], path: Path, command: str, before: dict[str, Any] | None = None
) -> None:
    """Write ``render(summary, command, before)`` to ``path`` (docs/reliability.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(summary, command, before))
