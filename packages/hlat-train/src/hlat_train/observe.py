"""What a run shows besides its metrics: Weights & Biases, profiler traces, memory snapshots,
and the per-rank compute time that points at a straggler.

Each piece uses the tool's own engine: ``wandb`` for the run page, ``torch.profiler`` for
traces (Chrome trace JSON that TensorBoard's profiler plugin and Perfetto read), and
``torch.cuda.memory``'s allocator history for snapshots (pytorch.org/memory_viz reads them).
"""

from __future__ import annotations

import os
import secrets
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

WANDB_ID_FILE = "wandb_run_id"
"""In ``train.out_dir``: the W&B run id, so that a resumed run logs into the same run."""


class WandbLogger:
    """One W&B run per training run (rank 0 only), resumed into after a restart.

    The run id is written to ``<out_dir>/wandb_run_id`` when the run is created and read
    back on restart (``resume="allow"``), so a run preempted and resumed by torchrun or a
    scheduler stays one run page. Mode, entity and credentials come from W&B's own
    environment (``WANDB_MODE=offline``, ``WANDB_API_KEY``, ...).

    Note: after a resume, the steps between the checkpoint and the crash are logged again;
    W&B keeps the first values of a step and warns about the repeats.
    """

    def __init__(self, out_dir: str, project: str, name: str) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "logging.wandb needs the wandb package: pip install 'hlat-train[wandb]'"
            ) from None
        from hlat_train.config import ConfigError

        os.makedirs(out_dir, exist_ok=True)
        id_path = os.path.join(out_dir, WANDB_ID_FILE)
        made = not os.path.exists(id_path)
        if not made:
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = secrets.token_hex(4)  # W&B ids: lowercase letters and digits
            with open(id_path + ".tmp", "w") as f:
                f.write(run_id + "\n")
            os.replace(id_path + ".tmp", id_path)
        self.run_id = run_id
        self._run: Any = None
        try:
            self._run = wandb.init(
                project=project,
                name=name or None,
                id=run_id,
                resume="allow",
                dir=out_dir,
            )
        except Exception as e:  # no credentials, an unknown entity, no network, ...
            if made:  # a run id that names no run
                os.remove(id_path)
            raise ConfigError(
                f"logging.wandb = true, but W&B did not start a run: {e} (log in with "
                "`wandb login` or set WANDB_API_KEY; WANDB_MODE=offline logs to out_dir "
                "without an account)"
            ) from e

    def update_config(self, config: dict[str, Any]) -> None:
        """Give the run its config (the run's, once everything ``auto`` is resolved)."""
        self._run.config.update(config, allow_val_change=True)

    def log(self, record: dict[str, Any]) -> None:
        """A metrics record, its numbers named by :func:`~hlat_train.metrics.metric_tags`."""
        from hlat_train.metrics import metric_tags

        if self._run is not None:
            self._run.log(metric_tags(record), step=int(record["step"]))

    def close(self) -> None:
        """Finish the run (once; later calls do nothing)."""
        run, self._run = self._run, None
        if run is not None:
            run.finish()


class StepProfiler:
    """``torch.profiler`` over the steps ``first`` to ``last`` (inclusive) of this rank.

    Writes ``<out_dir>/profile/rank<r>.<...>.pt.trace.json`` through torch's
    ``tensorboard_trace_handler``: a Chrome trace that Perfetto, ``chrome://tracing`` and
    TensorBoard's profiler plugin (``tensorboard --logdir <out_dir>/profile``) open. CPU
    activity always; the accelerator's own activity where torch's profiler knows it (CUDA).
    """

    def __init__(self, out_dir: str, rank: int, steps: list[int], device: torch.device) -> None:
        self.first, self.last = (steps[0], steps[-1]) if steps else (0, -1)
        self.dir = os.path.join(out_dir, "profile")
        self.rank = rank
        self.device = device
        self._prof: Any = None
        self._mark: Any = None
        self.written: list[str] = []

    def begin(self, step: int) -> None:
        """Call before the work of ``step``: starts the trace at the first step and marks
        each traced step as a range named ``step <n>``."""
        if not self.first <= step <= self.last:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        if self._prof is None:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda" and torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            os.makedirs(self.dir, exist_ok=True)
            self._prof = profile(
                activities=activities,
                on_trace_ready=tensorboard_trace_handler(self.dir, worker_name=f"rank{self.rank}"),
            )
            self._prof.start()
        self._mark = torch.profiler.record_function(f"step {step}")
        self._mark.__enter__()

    def end(self, step: int) -> None:
        """Call after the work of ``step`` (the trace is written after the last one)."""
        if self._prof is None:
            return
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (a run that ends inside the range keeps what it has)."""
        if self._prof is None:
            return
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        before = set(os.listdir(self.dir))
        self._prof.stop()
        self._prof = None
        self.written = sorted(os.path.join(self.dir, n) for n in set(os.listdir(self.dir)) - before)


class MemorySnapshot:
    """The allocator's history, dumped as a snapshot at ``step`` and on out-of-memory errors.

    CUDA only: torch records allocator history for its CUDA caching allocator
    (``torch.cuda.memory._record_memory_history``); other devices have no such history, and
    the run says so once instead of failing. Snapshots go to
    ``<out_dir>/memory/rank<r>_step<n>.pickle`` (``..._oom.pickle``); drag one onto
    pytorch.org/memory_viz.
    """

    MAX_ENTRIES = 100_000

    def __init__(self, out_dir: str, rank: int, step: int, device: torch.device) -> None:
        import torch

        self.dir = os.path.join(out_dir, "memory")
        self.rank = rank
        self.step = step
        self.supported = device.type == "cuda" and torch.cuda.is_available()
        self.note = ""
        if step and not self.supported:
            self.note = (
                f"logging.memory_snapshot_step {step}: memory snapshots need a CUDA device "
                f"(torch's allocator history); none is taken on {device.type}"
            )
        if step and self.supported:
            torch.cuda.memory._record_memory_history(max_entries=self.MAX_ENTRIES)

    def after(self, step: int) -> str | None:
        """Dump the snapshot after the chosen step; the path, or None."""
        if self.supported and self.step and step == self.step:
            return self.dump(f"step{step}")
        return None

    def on_oom(self) -> str | None:
        """Dump what led to an out-of-memory error (when history is being recorded)."""
        return self.dump("oom") if self.supported and self.step else None

    def dump(self, tag: str) -> str:
        import torch

        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"rank{self.rank}_{tag}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        print(f"hlat-train: memory snapshot {path}", file=sys.stderr)
        return path


def rank_compute_spread(seconds: float, device: torch.device) -> dict[str, float | int]:
    """Every rank's compute time of the logged step (all-gathered: one small collective):
    the fastest, the slowest and which rank was slowest. A rank much slower than the
    others is a straggler that all the others wait for."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    every = torch.empty(dist.get_world_size(), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every, mine)
    values = every.cpu()
    return {
        "compute_s_min": float(values.min()),
        "compute_s_max": float(values.max()),
        "slowest_rank": int(values.argmax()),
    }
