"""The README's examples, run as they are written (the ``run_readme`` fixture), and what
they print."""

from __future__ import annotations

import math
import re


def test_the_readme_examples_run_and_print_what_they_say(run_readme, capsys):
    namespace = run_readme()  # its own assert: the model's fused loss equals the logits' loss
    printed = capsys.readouterr().out.splitlines()
    loss, flops = re.fullmatch(r"loss (\S+), (\S+) MFLOP/token", printed[0]).groups()
    # a fresh model (HLAT's small init) predicts about uniformly: a loss near ln(vocab)
    assert abs(float(loss) - math.log(namespace["config"].vocab_size)) < 0.5
    assert float(flops) > 0
    assert printed[1] == "6,738,415,616 parameters"  # the figure its comment gives
    assert all(p.grad is not None for p in namespace["model"].parameters())
