"""Checkpoints on an object store: train to s3://, resume from it, export from it."""

from __future__ import annotations

import pytest
from train_helpers import tiny_config

from hlat_train import Trainer, export_hf


@pytest.mark.slow
def test_checkpoints_on_s3_resume_and_export(corpus, tmp_path, s3_bucket):
    url, options = s3_bucket
    extra = (f'--checkpoint.dir="{url}/run"', "--optim.decay_steps=4")
    for steps in (2, 4):
        trainer = Trainer(tiny_config(corpus, tmp_path, *extra, steps=steps))
        try:
            summary = trainer.fit()
        finally:
            trainer.close()
    assert summary["resumed_from"] == 2 and summary["step"] == 4
    out = export_hf(f"{url}/run", str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 0 and out
    # each checkpoint holds the config it was trained with
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    for step in (2, 4):
        assert fs.exists(f"{url}/run/step_{step:010d}/hlat-train-config.toml")
