"""The README's example, run as it is written (the ``run_readme`` fixture); then as its
comment says, with more steps (it resumes), and once more unchanged (nothing left to
train)."""

from __future__ import annotations

import math
import re

STEPS = '"--train.steps=4",'


def with_steps(steps: int):
    def edit(code: str) -> str:
        assert STEPS in code, "the README example no longer trains 4 steps"
        return code.replace(STEPS, f'"--train.steps={steps}",')

    return edit


def losses(printed: str, steps: int) -> tuple[float, float]:
    match = re.fullmatch(rf"steps to {steps}: loss (\S+) -> (\S+)\n", printed)
    assert match, printed
    return float(match[1]), float(match[2])


def test_the_readme_example_trains_then_resumes_as_its_comment_says(run_readme, capsys):
    run_readme()
    out = capsys.readouterr()
    first, last = losses(out.out, 4)
    assert math.isfinite(first) and math.isfinite(last)
    assert "resumed from" not in out.err
    run_readme(with_steps(8))  # the comment: again with --train.steps=8
    out = capsys.readouterr()
    _, last_of_8 = losses(out.out, 8)
    assert "resumed from step 4 of run/checkpoints" in out.err
    assert last_of_8 < first
    run_readme(with_steps(8))  # once more: the run is complete, and says so
    out = capsys.readouterr()
    assert out.out == "steps to 8: loss nan -> nan\n"
    assert "resumed from step 8" in out.err and "nothing left to train" in out.err
