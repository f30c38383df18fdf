"""The README's example, run as it is written, in a fresh directory: once, then again where
it auto-resumes from the first run's newest checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).parents[1] / "README.md"


def run_readme(namespace: dict) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    assert blocks, "the README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)


def test_the_readme_example_saves_keeps_two_and_resumes_when_run_again(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    first: dict = {"__name__": "__readme__"}
    run_readme(first)
    first["ckpt"].close()
    assert capsys.readouterr().out == "[2, 3] ['weight', 'bias']\n"  # keep_last=2
    again: dict = {"__name__": "__readme__"}
    torch.manual_seed(1)  # another fresh model: the resume must replace it
    run_readme(again)
    again["ckpt"].close()
    assert again["start"] == 3 and again["loader"] == {"position": 24}
    assert capsys.readouterr().out == "[5, 6] ['weight', 'bias']\n"
    # the optimizer went on from the first run's state: six AdamW steps in all, not three
    assert [int(s["step"]) for s in again["optimizer"].state.values()] == [6, 6]
