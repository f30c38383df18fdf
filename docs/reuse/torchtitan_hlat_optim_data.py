"""hlat-optim and hlat-data inside torchtitan's ``Trainer``: hlat-optim's AdamW (bf16 with
stochastic rounding) and its cosine schedule with warmup, and hlat-data's ``PackedLoader`` as
torchtitan's data loader, in a tiny torchtitan Llama 3 trained on CPU with gloo, checkpointed
by torchtitan (DCP), killed, and restarted with the same command.

    pip install hlat-optim "hlat-data[torch]" torchtitan triton
    python docs/reuse/torchtitan_hlat_optim_data.py OUT_DIR [--nproc 2] [--precision fp32]

The demo writes a small Arrow corpus (cut from the Python standard library's sources) and a
SentencePiece model, then runs torchtitan three times, each in fresh processes (one, or
``--nproc`` under torchrun with FSDP): ``whole`` trains 12 steps; ``resumed`` runs the same
command, checkpoints at step 4 (and 8, 12) and is killed after step 7; the same command again
loads step 4 and trains steps 5 to 12. It prints both runs' losses and writes
``OUT_DIR/report.json``: from step 5 on, the restarted run's batches (every rank's) and losses
are the uninterrupted run's, exactly.

Where each package goes in (torchtitan 0.3.0: every component is a ``Configurable`` whose
nested ``Config`` builds it, so each seam is a subclass with its own ``Config``):

- optimizer: ``OptimizersContainer`` builds one optimizer per ``optimizer_name`` of its
  ``param_groups`` through ``_resolve_optimizer_factory``, a fixed table (Adam, AdamW,
  DistMuon), not a registry; ``HlatOptimizers`` adds ``"HlatAdamW"`` to it. The container
  checkpoints the optimizers' own ``state_dict``, keyed by parameter name, so hlat-optim's
  state (bf16 moments, the step counts that key its rounding bits, the seed) goes through DCP.
- schedule: ``LRSchedulersContainer`` puts a ``LambdaLR`` on each optimizer with the function
  its ``Config.build`` makes; ``HlatCosine`` hands it hlat-optim's ``CosineWithWarmup`` (the
  function behind ``cosine_with_warmup``).
- data: any ``BaseDataLoader`` (a ``Stateful`` iterable of ``(inputs, labels)``);
  ``HlatPackedDataLoader`` wraps a ``PackedLoader`` and maps its batch to torchtitan's keys
  (``input``, ``positions``). torchtitan saves it in its checkpoint under ``dataloader``: the
  loader's own few integers, one entry per data-parallel rank.
- tokenizer: the ``Trainer`` builds one from ``hf_assets_path`` and hands it to the data
  loader; ``HlatTokenizer`` loads hlat-data's ``Tokenizer`` from that folder.

What CPU and gloo need, with torchtitan 0.3.0 and torch 2.13.0:

- two run-time patches, before torchtitan's trainer is imported (``_run_torchtitan_on_cpu``):
  torchtitan's device falls back to "cuda" when there is no accelerator, and it calls
  ``torch.distributed.set_timeout``, which torch 2.13 has under a private name only;
- ``triton`` installed: torchtitan 0.3.0 imports it unconditionally (a CUDA build of torch
  brings it, the CPU build does not);
- the attention swapped for torchtitan's ``ScaledDotProductAttention`` (``tiny_llama``), as
  torchtitan's own graph tests do: its language-model backends do not train on CPU
  (FlexAttention has no CPU backward in torch, varlen is flash attention, CUDA only). SDPA
  attends causally over the whole packed row, so the documents of a row are not masked from
  each other; with FlexAttention or varlen on a GPU, torchtitan masks them from the
  per-document ``positions`` this loader gives;
- ``spmd_backend="partial_dtensor"`` (plain FSDP2; torch 2.13's ``fully_shard`` rejects the
  parameters of the default "spmd_types" path with 2 ranks) and FSDP's gradient reduction
  forced to a plain sum (``_parallelize_for_gloo``): gloo has no ``PREMUL_SUM``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import sysconfig
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from hlat_data import ArrowSource, PackedLoader, Tokenizer, train_tokenizer
from hlat_data.torch import to_torch
from hlat_optim import AdamW, CosineWithWarmup


def _run_torchtitan_on_cpu() -> None:
    """Patches torchtitan 0.3.0 needs to train on a machine without an accelerator, with
    torch 2.13.0. Must run before any other torchtitan module is imported."""
    import torchtitan.tools.utils as tt_utils

    copies = ("torchtitan.trainer", "torchtitan.components.metrics", "torchtitan.distributed")
    assert not any(m in sys.modules for m in copies), "patch before importing the trainer"
    if tt_utils.device_type == "cuda" and not torch.cuda.is_available():
        # torchtitan picks its device once, when torchtitan.tools.utils is imported: the
        # available accelerator, else "cuda" (`_get_available_device_type() or "cuda"`), and
        # other modules copy `device_type`/`device_module` when they are imported. Here it is
        # the CPU, with a stand-in for the few device-module calls torchtitan makes (device
        # selection, memory statistics for its log line, a barrier's device id).
        tt_utils.device_type = "cpu"
        tt_utils.device_module = types.SimpleNamespace(
            set_device=lambda device: None,
            device_count=lambda: 1,
            current_device=lambda: 0,
            synchronize=lambda device=None: None,
            get_device_name=lambda device=None: "cpu",
            get_device_properties=lambda device=None: types.SimpleNamespace(
                total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            ),
            memory_stats=lambda device=None: {},
            reset_peak_memory_stats=lambda device=None: None,
            empty_cache=lambda: None,
        )
    if not hasattr(dist, "set_timeout"):
        # torchtitan sets the process groups' timeout after the first step with
        # torch.distributed.set_timeout (distributed/utils.py, set_pg_timeouts), which torch
        # 2.13 has under its private name only.
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout


_run_torchtitan_on_cpu()

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import (  # noqa: E402
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
)
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry, parallelize_llama  # noqa: E402
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

# --- hlat-optim --------------------------------------------------------------------------


class HlatOptimizers(OptimizersContainer):
    """torchtitan's optimizer container, which also knows ``optimizer_name="HlatAdamW"``."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == "HlatAdamW":
            return AdamW
        return OptimizersContainer._resolve_optimizer_factory(name)

    @staticmethod
    def _build_impl_kwargs(config: OptimizersContainer.Config) -> dict[str, Any]:
        # Note: the container puts torch.optim's `fused`/`foreach` switches into every param
        # group; hlat-optim's AdamW chooses its kernel itself (`impl="auto"`).
        return {}


class HlatCosine(LRSchedulersContainer):
    """torchtitan's scheduler container with hlat-optim's schedule: linear warmup from 0 over
    ``warmup_steps``, then a cosine from each group's ``lr`` to ``min_lr_ratio * lr`` at
    ``total_steps`` (default: ``training.steps``). The parent's ``decay_*`` and
    ``min_lr_factor`` fields are not used."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        min_lr_ratio: float = 0.1
        constant_steps: int = 0

        def build(self, *, optimizers, training_steps):
            total = self.total_steps if self.total_steps is not None else training_steps
            schedule = CosineWithWarmup(
                self.warmup_steps, total, self.min_lr_ratio, self.constant_steps
            )
            return HlatCosine(optimizers, schedule)


# --- hlat-data ---------------------------------------------------------------------------


class HlatTokenizer(BaseTokenizer):
    """hlat-data's ``Tokenizer`` from the trainer's ``hf_assets_path``, a folder (as
    torchtitan's checkpointer expects) holding ``tokenizer.model`` (SentencePiece) or
    ``tokenizer.json``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path: str) -> None:
        super().__init__()
        folder = Path(tokenizer_path)
        path = folder / "tokenizer.model"
        self.hlat = Tokenizer.from_file(path if path.exists() else folder / "tokenizer.json")
        self.eos_id = self.hlat.eos_id

    def encode(self, text: str) -> list[int]:
        return self.hlat.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.hlat.decode(ids)

    def get_vocab_size(self) -> int:
        return self.hlat.vocab_size


class HlatPackedDataLoader(BaseDataLoader):
    """``PackedLoader`` over the Arrow files at ``dataset_path``, this rank's share, as
    torchtitan's ``({"input": ids, "positions": positions}, labels)`` batches.

    ``state_dict`` holds the loader's cursor under this rank's own key (torchtitan's DCP
    checkpoint gathers every rank's entry), as JSON: the state is plain data whose nesting
    changes after a resume, which DCP, loading into the keys of a fresh state, would not
    match. ``record`` (a folder) gets each batch's index (counted across resumes) and tokens
    appended to ``record-rank{r}.jsonl``, for the demo's comparison.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0
        block_size: int = 16
        num_workers: int = 0
        """hlat-data's tokenizer processes (the batches are the same for any number)."""
        record: str | None = None

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: HlatTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = None,
    ) -> None:
        assert config.dataset_path, "dataloader.dataset_path: the Arrow corpus"
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.packed = PackedLoader(
            ArrowSource(config.dataset_path),
            tokenizer.hlat,
            seq_len,
            local_batch_size,
            dp_rank,
            dp_world_size,
            seed=config.seed,
            block_size=config.block_size,
            num_workers=config.num_workers,
        )
        self.record = Path(config.record) / f"record-rank{dp_rank}.jsonl" if config.record else None

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.packed:
            t = to_torch(batch)
            if self.record is not None:
                index = self.packed.state_dict()["batches"]  # 1-based, counted across resumes
                line = {"batch": index, "input_ids": t["input_ids"].tolist()}
                with self.record.open("a") as f:
                    f.write(json.dumps(line) + "\n")
            yield {"input": t["input_ids"], "positions": t["position_ids"]}, t["labels"]

    def state_dict(self) -> dict[str, Any]:
        return {
            f"dp_rank_{self.dp_rank}": json.dumps(self.packed.state_dict()),
            "dp_world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = state_dict.get(f"dp_rank_{self.dp_rank}")
        if mine is None:
            return
        assert state_dict["dp_world_size"] == self.dp_world_size, (
            "resuming with another data-parallel size: merge the ranks' states with "
            "hlat_data.merge_states first"
        )
        self.packed.load_state_dict(json.loads(mine))


# --- a loss record, and a crash on request -----------------------------------------------


class RecordingMetrics(MetricsProcessor):
    """torchtitan's metrics, and each step's loss and learning rate appended to
    ``record/losses.jsonl`` (rank 0); ``stop_after``: the process dies after that step, as a
    killed job would (no cleanup, no final checkpoint)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        record: str | None = None
        stop_after: int | None = None

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        if self.config.record and dist.get_rank() == 0:
            lr = next((v for k, v in (extra_metrics or {}).items() if k.startswith("lr/")), None)
            line = {"step": step, "loss": global_avg_loss, "grad_norm": grad_norm, "lr": lr}
            with (Path(self.config.record) / "losses.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
        if self.config.stop_after == step:
            os._exit(17)


# --- the model and the trainer's configuration -------------------------------------------


def tiny_llama(vocab_size: int, n_layers: int = 2) -> ModelSpec:
    """torchtitan's Llama 3 ``debugmodel`` (dim 256, 16 heads) with ``n_layers`` layers, our
    tokenizer's vocabulary, and SDPA attention (FlexAttention and varlen do not train on CPU;
    torchtitan's own graph tests swap the same way)."""
    spec = model_registry("debugmodel")
    model = spec.model
    model.vocab_size = vocab_size
    model.tok_embeddings.num_embeddings = vocab_size
    model.lm_head.out_features = vocab_size
    model.layers = model.layers[:n_layers]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return dataclasses.replace(spec, parallelize_fn=_parallelize_for_gloo)


def _parallelize_for_gloo(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """torchtitan's Llama 3 parallelization, with FSDP's gradient reduction as a plain sum:
    torchtitan turns FSDP's gradient division off (factor 1, it divides the loss by the
    global token count), which FSDP does with ``ReduceOp.PREMUL_SUM``, an op gloo lacks."""
    model = parallelize_llama(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def trainer_config(
    out: Path,
    data: Path,
    *,
    steps: int = 12,
    checkpoint_every: int = 4,
    precision: str = "bf16-sr",
    stop_after: int | None = None,
) -> Trainer.Config:
    """The whole run: ``precision`` is ``"bf16-sr"`` (bf16 parameters, gradients and
    moments, stochastic rounding; torchtitan's ``training.dtype="bfloat16"`` holds the model
    in bf16 with no fp32 copy) or ``"fp32"`` (fp32 throughout: FSDP's mixed-precision
    policy, bf16 compute by default, is set to fp32 too). For hlat-optim's mixed precision,
    keep bf16 and add ``"master_weights": True`` to the optimizer's kwargs."""
    tokenizer = Tokenizer.from_file(data / "tokenizer.model")
    lr, warmup = 3e-3, 2
    dtype = {"bf16-sr": "bfloat16", "fp32": "float32"}[precision]
    return Trainer.Config(
        model_spec=tiny_llama(tokenizer.vocab_size),
        loss=CrossEntropyLoss.Config(global_vocab_size=tokenizer.vocab_size),
        hf_assets_path=str(data),
        dump_folder=str(out),
        tokenizer=HlatTokenizer.Config(),
        dataloader=HlatPackedDataLoader.Config(
            dataset_path=str(data / "corpus.arrow"), seed=0, block_size=8, record=str(out)
        ),
        optimizer=HlatOptimizers.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name="HlatAdamW",
                    optimizer_kwargs={
                        "lr": lr,
                        "betas": (0.9, 0.95),
                        "eps": 1e-8,
                        "weight_decay": 0.1,
                    },
                )
            ]
        ),
        lr_scheduler=HlatCosine.Config(warmup_steps=warmup, min_lr_ratio=0.1),
        training=TrainingConfig(
            local_batch_size=8,
            seq_len=64,
            steps=steps,
            max_norm=1.0,
            dtype=dtype,
            mixed_precision_param=dtype,
            disable_cuda_graphs=True,
        ),
        metrics=RecordingMetrics.Config(
            log_freq=1, disable_color_printing=True, record=str(out), stop_after=stop_after
        ),
        checkpoint=CheckpointManager.Config(
            enable=True, interval=checkpoint_every, last_save_model_only=False
        ),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        activation_checkpoint=None,
        debug=DebugConfig(seed=0),
    )


def single_process_env() -> None:
    """Outside torchrun, the environment of a one-process group on a free local port (what
    torchtitan's trainer reads to initialise its process group)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip


def train(out: Path, data: Path, **config: Any) -> None:
    """One torchtitan run in this process (under torchrun, or alone: then a one-process
    gloo group on a free port), resuming from the newest checkpoint in ``out``."""
    single_process_env()
    init_logger()
    out.mkdir(parents=True, exist_ok=True)
    trainer = trainer_config(out, data, **config).build()
    try:
        assert all(isinstance(o, AdamW) for o in trainer.optimizers)
        trainer.train()
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# --- the demo ----------------------------------------------------------------------------


def write_data(data: Path, documents: int = 96, vocab_size: int = 512) -> None:
    """An Arrow corpus of standard-library sources, cut to varied lengths, and a
    SentencePiece model trained on it."""
    data.mkdir(parents=True, exist_ok=True)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:documents]
    texts = [f.read_text(errors="replace")[: 200 + (i * 397) % 1500] for i, f in enumerate(files)]
    table = pa.table({"text": texts})
    with pa.ipc.new_file(data / "corpus.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=16)
    model = train_tokenizer(str(data / "corpus.arrow"), str(data / "tokenizer"), vocab_size)
    assert Path(model) == data / "tokenizer.model", model


def launch(out: Path, data: Path, nproc: int, *extra: str) -> int:
    """This script's ``--worker`` in fresh processes: alone, or ``nproc`` under torchrun."""
    me = [os.path.abspath(__file__), str(out), "--data", str(data), "--worker", *extra]
    if nproc == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *me]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, env=env).returncode


def read_run(out: Path, nproc: int) -> dict[str, Any]:
    """A run's records: losses by step (the last attempt's, for a step run twice) and each
    rank's batches by index."""
    losses = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        r = json.loads(line)
        losses[r["step"]] = r
    batches = []
    for rank in range(nproc):
        seen = {}
        for line in (out / f"record-rank{rank}.jsonl").read_text().splitlines():
            r = json.loads(line)
            seen[r["batch"]] = r["input_ids"]
        batches.append(seen)
    return {"losses": losses, "batches": batches}


def demo(
    out: Path,
    nproc: int = 1,
    precision: str = "bf16-sr",
    steps: int = 12,
    checkpoint_every: int = 4,
    kill_after: int = 7,
) -> dict[str, Any]:
    """Writes the data, runs ``whole``, then ``resumed`` killed after ``kill_after`` and
    restarted with the same command, and compares the two; returns (and writes to
    ``out/report.json``) what it found."""
    data = out / "data"
    write_data(data)
    opts = ["--steps", str(steps), "--precision", precision, "--checkpoint-every",
            str(checkpoint_every)]  # fmt: skip
    assert launch(out / "whole", data, nproc, *opts) == 0
    assert launch(out / "resumed", data, nproc, *opts, "--stop-after", str(kill_after)) != 0
    assert launch(out / "resumed", data, nproc, *opts) == 0  # the same command again
    whole, resumed = read_run(out / "whole", nproc), read_run(out / "resumed", nproc)
    start = kill_after // checkpoint_every * checkpoint_every + 1  # first step after the restart
    after = range(start, steps + 1)
    report = {
        "nproc": nproc,
        "precision": precision,
        "restarted_at_step": start,
        "whole_losses": [whole["losses"][s]["loss"] for s in range(1, steps + 1)],
        "resumed_losses": [resumed["losses"][s]["loss"] for s in range(1, steps + 1)],
        "lrs": [whole["losses"][s]["lr"] for s in range(1, steps + 1)],
        "batches_equal_after_restart": all(
            whole["batches"][r][s] == resumed["batches"][r][s] for r in range(nproc) for s in after
        ),
        "losses_equal_after_restart": all(
            whole["losses"][s]["loss"] == resumed["losses"][s]["loss"] for s in after
        ),
        "checkpoints": sorted(p.name for p in (out / "resumed" / "checkpoint").iterdir()),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--precision", choices=("bf16-sr", "fp32"), default="bf16-sr")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        train(
            args.out, args.data, steps=args.steps, precision=args.precision,
            checkpoint_every=args.checkpoint_every, stop_after=args.stop_after,
        )  # fmt: skip
        return
    report = demo(args.out, args.nproc, args.precision, args.steps, args.checkpoint_every)
    print("losses, uninterrupted:", [round(x, 4) for x in report["whole_losses"]])
    print("losses, restarted:    ", [round(x, 4) for x in report["resumed_losses"]])
    print(
        f"restarted at step {report['restarted_at_step']}; batches and losses from there on "
        f"equal: {report['batches_equal_after_restart']}, {report['losses_equal_after_restart']}"
    )


if __name__ == "__main__":
    main()
