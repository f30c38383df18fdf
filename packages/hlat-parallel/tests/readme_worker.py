"""One rank of the README's quick-start, launched by tests/test_readme.py with torchrun's
environment.

Usage: readme_worker.py WORKDIR [TP]. Runs the README's ```python block, with
``init_parallel(tp=1)`` replaced by ``init_parallel(tp=TP, sp=True)`` when TP is given (as
the README says to run it under torchrun), and writes what it printed to
WORKDIR/rank<r>.txt.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

from spawn import end_worker

README = Path(__file__).parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def main() -> None:
    workdir = Path(sys.argv[1])
    (code,) = BLOCK.findall(README.read_text())
    if len(sys.argv) > 2:
        single = "init_parallel(tp=1)"
        assert single in code, f"the README example no longer calls {single}"
        code = code.replace(single, f"init_parallel(tp={int(sys.argv[2])}, sp=True)")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    (workdir / f"rank{os.environ['RANK']}.txt").write_text(printed.getvalue())


if __name__ == "__main__":
    main()
    end_worker()
