"""Pre-flight health checks for a training job, as a script: ``hlat-train preflight``.

The checks, options, output and exit codes are those of the ``hlat-train preflight``
command (:mod:`hlat_train.preflight`, which documents them); this script keeps launch
scripts that run it by path working::

    python tools/preflight.py --checkpoint-url /fsx/ckpt                  # one process
    torchrun --nproc-per-node 2 tools/preflight.py --checkpoint-url DIR   # every rank

Needs ``hlat-train`` installed (``pip install hlat-train``).
"""

from __future__ import annotations

import sys

from hlat_train.preflight import (  # noqa: F401  the names this script used to define
    Check,
    check_all_reduce,
    check_checkpoint_io,
    check_devices,
    check_free_disk,
    check_port,
    check_stale_processes,
    format_table,
    main,
    parse_args,
    parse_neuron_ls,
)

if __name__ == "__main__":
    sys.exit(main(prog="tools/preflight.py"))
