"""The README's examples, run as they are written (the ``run_readme`` fixture), and what
they print."""

from __future__ import annotations

import re

import pytest
import torch


def test_the_readme_examples_run_and_print_what_they_say(run_readme, tmp_path, capsys):
    # the resume's load says, as the README says, that it made the master weights
    with pytest.warns(UserWarning, match="made fp32 master weights from the parameters"):
        namespace = run_readme()  # its own assert: master weights equal the loaded parameters
    (line,) = capsys.readouterr().out.splitlines()
    loss, norm, lr = re.fullmatch(r"loss (\S+), grad norm (\S+), lr (\S+)", line).groups()
    assert float(loss) > 0 and 0 < float(norm) <= 1e3
    sched = namespace["sched"]
    assert float(lr) == pytest.approx(sched.get_last_lr()[0], rel=1e-2)
    assert sched.last_epoch == 20  # 20 steps: 10 of warmup, 10 down the cosine
    model, resumed = namespace["model"], namespace["resumed"]
    for saved, loaded in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(saved, loaded)
    assert (tmp_path / "ckpt" / ".metadata").is_file()
