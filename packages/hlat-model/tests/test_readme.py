"""The README's examples, run as they are written: each ```python block in order, in one
namespace (a later block uses what an earlier one made), in a fresh directory."""

from __future__ import annotations

import math
import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def run_readme(namespace: dict) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    assert blocks, "the README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)


def test_the_readme_examples_run_and_print_what_they_say(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    run_readme(namespace)  # its own assert: the model's fused loss equals the logits' loss
    printed = capsys.readouterr().out.splitlines()
    loss, flops = re.fullmatch(r"loss (\S+), (\S+) MFLOP/token", printed[0]).groups()
    # a fresh model (HLAT's small init) predicts about uniformly: a loss near ln(vocab)
    assert abs(float(loss) - math.log(namespace["config"].vocab_size)) < 0.5
    assert float(flops) > 0
    assert printed[1] == "6,738,415,616 parameters"  # the figure its comment gives
    assert all(p.grad is not None for p in namespace["model"].parameters())
