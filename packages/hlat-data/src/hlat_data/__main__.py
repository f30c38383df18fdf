"""``python -m hlat_data``: the ``hlat-data`` command."""

from hlat_data.cli import main

raise SystemExit(main())
