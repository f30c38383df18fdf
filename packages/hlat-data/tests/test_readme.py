"""The README's examples, run as they are written (the ``run_readme`` fixture), and what
they print."""

from __future__ import annotations

import re


def test_the_readme_examples_run_and_print_what_they_say(run_readme, capsys):
    namespace = run_readme()  # its asserts: the resumed loader and the JSON-lines one match
    printed = capsys.readouterr().out.splitlines()
    shape, doc_lens = re.fullmatch(r"\((\d+, \d+)\) (\[.*\])", printed[0]).groups()
    assert shape == "4, 128"
    lengths = [int(n) for n in doc_lens.strip("[]").split()]
    assert sum(lengths) == 128 and all(n >= 0 for n in lengths)
    composition = namespace["mixture"].composition()
    assert printed[1] == str(composition)
    assert set(composition) == {"web", "code"}
    assert printed[2] == "JsonlSource(200 documents in 1 file(s), field 'text') 0"  # none bad

    # the helper of the multi-rank section, in one process: every batch of an epoch
    def one_epoch():
        return namespace["PackedLoader"](
            namespace["ArrowSource"]("corpus.arrow"),
            namespace["tokenizer"],
            128,
            4,
            0,
            1,
            seed=0,
            block_size=16,
            num_epochs=1,
        )

    every = list(one_epoch())
    assert len(every) > 1
    assert len(list(namespace["until_any_rank_ends"](one_epoch()))) == len(every)
