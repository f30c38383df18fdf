"""One rank of a run that starts from Hugging Face weights: sets the trainer up, then writes
what it holds and what it read.

Usage: hf_init_worker.py CONFIG OUT_DIR (under torchrun). Writes OUT_DIR/rank<r>.pt: every
parameter gathered whole, this rank's local element count, and the elements a fresh
``load_hf_weights`` into the same layout reads.
"""

from __future__ import annotations

import os

import torch
from train_helpers import run_worker

from hlat_model.hf_load import load_hf_weights
from hlat_train import TrainConfig, Trainer


def main(config_path: str, out_dir: str) -> None:
    trainer = Trainer(TrainConfig.from_toml(config_path))
    try:
        trainer._setup()
        model = trainer.model
        full, local = {}, 0
        for name, param in model.named_parameters():
            value = param.detach()
            local += value.to_local().numel() if hasattr(value, "to_local") else value.numel()
            full[name] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
        read = load_hf_weights(model, trainer.config.model.init_from_hf, trainer.llama_config)
        rank = int(os.environ["RANK"])
        torch.save({"full": full, "local": local, "read": read}, f"{out_dir}/rank{rank}.pt")
    finally:
        trainer.close()


if __name__ == "__main__":
    run_worker(main)
