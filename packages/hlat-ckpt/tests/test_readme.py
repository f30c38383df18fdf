"""The README's example, run as it is written (the ``run_readme`` fixture): once, then again
where it auto-resumes from the first run's newest checkpoint."""

from __future__ import annotations

import torch


def test_the_readme_example_saves_keeps_two_and_resumes_when_run_again(run_readme, capsys):
    first = run_readme()
    first["ckpt"].close()
    assert capsys.readouterr().out == "[2, 3] ['weight', 'bias']\n"  # keep_last=2
    torch.manual_seed(1)  # another fresh model: the resume must replace it
    again = run_readme()
    again["ckpt"].close()
    assert again["start"] == 3 and again["loader"] == {"position": 24}
    assert capsys.readouterr().out == "[5, 6] ['weight', 'bias']\n"
    # the optimizer went on from the first run's state: six AdamW steps in all, not three
    assert [int(s["step"]) for s in again["optimizer"].state.values()] == [6, 6]
