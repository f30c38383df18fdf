"""torchtitan's ``Trainer`` on the trainer benchmark's Llama shape, on CPU, timed per step.

Run by ``test_bench_vs_torchtitan.py``, alone or under torchrun::

    python torchtitan_worker.py DATA OUT --shape JSON [--precision bf16|fp32|mixed]
        [--steps N] [--compile] [--full-ac]

``DATA`` holds ``corpus.arrow`` and ``tokenizer.model``. Rank 0 writes ``OUT/steps.jsonl``: per
step, its loss and the seconds since the previous step's metrics (the whole step: data,
forward, backward, clipping, optimizer, metrics). torchtitan runs as it ships, with its own
AdamW (torch's fused kernel), loss, clipping and FSDP2; what CPU and gloo need is set up by
``docs/reuse/torchtitan_hlat_optim_data.py`` (see its docstring), whose tokenizer and data
loader (hlat-data's ``PackedLoader``) feed it the same batches hlat-train reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "docs" / "reuse"))

import torchtitan_hlat_optim_data as reuse  # first: it patches torchtitan for a CPU
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import (
    Llama3Model,
    _build_llama3_layers,  # the builder of its own flavours (torchtitan 0.3)
    model_registry,
)
from torchtitan.tools.logging import init_logger
from torchtitan.trainer import Trainer

DTYPES = {  # setting -> (training.dtype, FSDP's mixed_precision_param)
    "bf16": ("bfloat16", "bfloat16"),
    "fp32": ("float32", "float32"),
    "mixed": ("float32", "bfloat16"),
}


class StepTimes(MetricsProcessor):
    """torchtitan's metrics (logged every step), and on rank 0 each step's loss and the time
    since the previous step's log appended to ``record/steps.jsonl``."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        record: str = ""

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        now = time.perf_counter()
        last = getattr(self, "_last_log", None)
        self._last_log = now
        if dist.get_rank() == 0 and last is not None:
            line = {"step": step, "loss": global_avg_loss, "step_s": now - last}
            with (Path(self.config.record) / "steps.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")


def llama(shape: dict[str, int]) -> object:
    """torchtitan's Llama 3 at ``shape`` (vocab, dim, layers, heads, ffn, seq), every head its
    own key/value head, RoPE without frequency scaling, SDPA causal attention."""
    spec = model_registry("debugmodel")
    base = spec.model
    dim, vocab = shape["dim"], shape["vocab_size"]
    layers = _build_llama3_layers(
        fuse_qkv=True,
        n_layers=shape["n_layers"],
        dim=dim,
        n_heads=shape["n_heads"],
        hidden_dim=shape["ffn_dim"],
        rope=ComplexRoPE.Config(
            dim=dim // shape["n_heads"], max_seq_len=shape["seq_len"], theta=10000.0
        ),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=base.tok_embeddings.param_init
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=base.norm.param_init),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=base.lm_head.param_init
        ),
        layers=layers,
    )
    return dataclasses.replace(spec, model=model, parallelize_fn=reuse._parallelize_for_gloo)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--precision", choices=DTYPES, default="bf16")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--shape", type=json.loads, required=True)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--compile", action="store_true", help="compile.enable (model, loss)")
    parser.add_argument(
        "--full-ac", action="store_true", help="activation_checkpoint: FullAC (each block)"
    )
    args = parser.parse_args()
    reuse.single_process_env()
    init_logger()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype, param_dtype = DTYPES[args.precision]
    shape = args.shape
    config = Trainer.Config(
        model_spec=llama(shape),
        loss=CrossEntropyLoss.Config(global_vocab_size=shape["vocab_size"]),
        hf_assets_path=str(args.data),
        dump_folder=str(args.out),
        tokenizer=reuse.HlatTokenizer.Config(),
        dataloader=reuse.HlatPackedDataLoader.Config(
            dataset_path=str(args.data / "corpus.arrow"), seed=0, block_size=64
        ),
        optimizer=OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={
                        "lr": args.lr,
                        "betas": (0.9, 0.95),
                        "eps": 1e-8,
                        "weight_decay": 0.1,
                    },
                )
            ]
        ),
        training=TrainingConfig(
            local_batch_size=args.micro_batch,
            seq_len=shape["seq_len"],
            steps=args.steps,
            max_norm=1.0,
            dtype=dtype,
            mixed_precision_param=param_dtype,
            disable_cuda_graphs=True,
        ),
        metrics=StepTimes.Config(log_freq=1, disable_color_printing=True, record=str(args.out)),
        checkpoint=CheckpointManager.Config(enable=False),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        activation_checkpoint=FullAC.Config() if args.full_ac else None,
        compile=CompileConfig(enable=args.compile),
        debug=DebugConfig(seed=0),
    )
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
