"""Training-step time of `Trainer` against a bare PyTorch loop on the same model and data.

The peer is what a user would write by hand: `hlat_model.Llama`, `hlat_data.PackedLoader`,
`torch.optim.AdamW(fused=True)`, `clip_grad_norm_`, nothing else. The ratio is the price of
everything `Trainer` adds per unlogged step (spike guard, DP-aware loss averaging,
clipping, hlat-optim's AdamW). Run: ``nox -s bench -- packages/hlat-train/benchmarks``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

STEPS = 12  # timed steps per round, after 3 warm-up steps


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from hlat_data import train_tokenizer
    from hlat_train.demo import stdlib_files

    root = tmp_path_factory.mktemp("bench")
    texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in stdlib_files()[:300]]
    table = pa.table({"text": pa.array(texts, pa.string())})
    with (
        pa.OSFile(str(root / "train.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as w,
    ):
        w.write_table(table)
    tokenizer = train_tokenizer(str(root / "train.arrow"), str(root / "tok.model"), 4096)
    return {"train": str(root / "train.arrow"), "tokenizer": tokenizer, "root": root}


def _config(corpus, out: str):
    from hlat_train import TrainConfig

    return TrainConfig.preset(
        "tiny-demo",
        [
            f'--data.paths=["{corpus["train"]}"]',
            f'--data.tokenizer="{corpus["tokenizer"]}"',
            f'--train.out_dir="{out}"',
            "--train.steps=1000000",
            "--model.compile=false",  # eager, as measured before "auto" (which would compile)
            "--optim.decay_steps=1000",
            "--train.eval_every=0",
            "--train.time_limit=0",
            "--checkpoint.every=1000000",
            "--logging.progress=false",
            "--logging.plot=false",
            "--data.block_size=64",
        ],
    )


def test_trainer_step(benchmark, corpus, tmp_path):
    from hlat_train import Trainer

    config = _config(corpus, str(tmp_path))
    trainer = Trainer(config)
    trainer._setup()
    batches = trainer._batches()

    def steps() -> None:
        for _ in range(STEPS):
            loss = trainer._forward_backward(next(batches), True)
            # clip, spike guard and the optimizer step, as an unlogged step of fit() runs them
            trainer._update(trainer._mean_over_dp(loss.detach()))
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.scheduler.step()

    steps()  # warm-up: compiles the AdamW update
    benchmark.pedantic(steps, rounds=3, iterations=1)
    trainer.close()


def test_bare_loop_step(benchmark, corpus):
    from hlat_data import ArrowSource, PackedLoader, Tokenizer
    from hlat_model import Llama, cross_entropy_loss

    config = _config(corpus, str(corpus["root"] / "bare"))
    torch.manual_seed(0)
    model = Llama(config.llama_config(4096))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    loader = PackedLoader(
        ArrowSource(corpus["train"]),
        Tokenizer.from_file(corpus["tokenizer"]),
        256,
        8,
        block_size=64,
    )
    batches = iter(loader)

    def steps() -> None:
        for _ in range(STEPS):
            batch = next(batches)
            logits = model(torch.from_numpy(batch.input_ids).long())
            cross_entropy_loss(logits, torch.from_numpy(batch.labels).long()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    steps()
    benchmark.pedantic(steps, rounds=3, iterations=1)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "--benchmark-only", *os.sys.argv[1:]]))
