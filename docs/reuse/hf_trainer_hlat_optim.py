"""hlat-optim in Hugging Face's ``Trainer``: AdamW with bf16 stochastic rounding and the
cosine schedule with warmup, training a tiny Llama held in bf16, checkpointed and resumed by
``Trainer`` itself (its optimizer.pt and scheduler.pt hold hlat-optim's state).

    pip install hlat-optim transformers accelerate
    python docs/reuse/hf_trainer_hlat_optim.py OUT_DIR
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hlat_optim import AdamW, cosine_with_warmup


class Counting(torch.utils.data.Dataset):
    """Rows of 32 tokens that count up from a start: a pattern a tiny model learns quickly."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(32) + 7 * i) % 200 + 1
        return {"input_ids": ids, "labels": ids.clone()}


def train(out: str, steps: int = 12, resume: str | None = None) -> Trainer:
    torch.manual_seed(0)
    shape = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(shape).to(torch.bfloat16)  # bf16 weights, no fp32 master copy
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)  # stochastic rounding
    scheduler = cosine_with_warmup(optimizer, warmup_steps=2, total_steps=steps)
    args = TrainingArguments(
        out, max_steps=steps, per_device_train_batch_size=8, save_steps=6, logging_steps=1,
        use_cpu=True, report_to=[], seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=Counting(), optimizers=(optimizer, scheduler)
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


if __name__ == "__main__":
    history = train(sys.argv[1]).state.log_history
    print([round(r["loss"], 3) for r in history if "loss" in r])
