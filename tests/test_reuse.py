"""The examples of docs/reuse run for real: each package inside a trainer it was not written
for, on CPU, on tiny shapes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
REUSE = ROOT / "docs" / "reuse"

pytestmark = pytest.mark.slow


def _torchrun(script: Path, *args: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [*cmd, str(script), *args],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def _worker_pids(launcher: int) -> list[int]:
    """The worker processes torchrun started (its children)."""
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(launcher)], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]


@pytest.mark.faults
def test_ddp_loop_resumes_after_a_sigkill_and_ends_where_an_uninterrupted_run_does(tmp_path):
    from hlat_ckpt import Checkpointer, consolidate

    script = REUSE / "ddp_auto_resume.py"
    # Note: the worker is killed once a checkpoint of step 10 is listed; the steps after it
    # leave room for the time between that write and the kill on a loaded machine (40 steps
    # were not always enough: the run had saved its last checkpoint before the kill).
    steps = "200"
    whole = _torchrun(script, str(tmp_path / "whole"), steps)
    output, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, output[-3000:]

    out = tmp_path / "killed"
    first = _torchrun(script, str(out), steps)
    deadline = time.monotonic() + 120
    while not any(c.step >= 10 for c in Checkpointer(str(out / "checkpoints")).list()):
        assert first.poll() is None and time.monotonic() < deadline, "no checkpoint at step 10"
        time.sleep(0.05)
    os.kill(_worker_pids(first.pid)[0], signal.SIGKILL)
    killed, _ = first.communicate(timeout=120)
    assert first.returncode != 0, killed[-2000:]
    kept = [c.step for c in Checkpointer(str(out / "checkpoints")).list()]
    assert kept and max(kept) < int(steps)

    again = _torchrun(script, str(out), steps)
    resumed, _ = again.communicate(timeout=300)
    assert again.returncode == 0, resumed[-3000:]
    # it started after the newest checkpoint, not from step 1
    assert f"step {max(kept) + 1} loss" in resumed and "step 1 loss" not in resumed
    a = consolidate(str(tmp_path / "whole" / "checkpoints"))
    b = consolidate(str(out / "checkpoints"))
    for part in ("model", "optimizer"):
        flat_a, flat_b = _tensors(a[part]), _tensors(b[part])
        assert flat_a.keys() == flat_b.keys() and flat_a
        assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), part


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by its path."""
    if torch.is_tensor(tree):
        return {prefix: tree}
    if isinstance(tree, dict):
        found = {}
        for key, value in tree.items():
            found.update(_tensors(value, f"{prefix}/{key}"))
        return found
    if isinstance(tree, (list, tuple)):
        return _tensors(dict(enumerate(tree)), prefix)
    return {}


def test_an_exported_checkpoint_generates_and_lm_eval_scores_it_as_transformers_does(
    tmp_path, reuse_example, monkeypatch
):
    """docs/reuse/hf_generate_and_lm_eval.py on a 20-step tiny-check run: transformers
    generates from the export, and lm_eval's log-likelihood of each choice is the exported
    model's own (run by transformers), so its accuracy is too. Needs lm_eval, which is not a
    test dependency: it runs in ``nox -s tests-eval``."""
    pytest.importorskip(
        "lm_eval", reason="lm-evaluation-harness is not installed (nox -s tests-eval)"
    )
    import importlib.util

    import transformers

    spec = importlib.util.spec_from_file_location("evaluate_tool", ROOT / "tools" / "evaluate.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setenv("HLAT_CACHE", str(tmp_path / "cache"))
    checkpoints = tool.train_short_run(tmp_path / "run", 20)

    example = reuse_example("hf_generate_and_lm_eval")
    model_dir = example.export(checkpoints, str(tmp_path / "out"))
    text = example.generate(model_dir, "def ", 8)
    assert text.startswith("def ") and len(text) > len("def ")
    result = example.score(model_dir, example.write_task(str(tmp_path / "out")))

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    samples = sorted(result["samples"], key=lambda s: s["doc_id"])
    assert len(samples) == len(example.ITEMS)
    correct = 0
    for sample, (context, choices, label) in zip(samples, example.ITEMS, strict=True):
        theirs = [r[0][0] for r in sample["resps"]]
        ours = []
        for choice in choices:
            # as lm_eval scores a pair: the context's trailing whitespace (here its
            # newline) moves to the continuation; the continuation's tokens are those of
            # the whole text after as many tokens as the context alone has, and the model
            # reads the context's own tokens followed by them
            encode = partial(tokenizer.encode, add_special_tokens=False)
            head = encode(context.rstrip())
            tail = encode(context + choice)[len(head) :]
            ids = head + tail
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            ours.append(sum(float(logits[i - 1, ids[i]]) for i in range(len(head), len(ids))))
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-3)
        correct += max(range(2), key=lambda i: theirs[i]) == label
    assert result["metrics"]["acc,none"] == pytest.approx(correct / len(samples))
