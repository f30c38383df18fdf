"""The fault campaign behind ``tools/fault_campaign.py`` (the command line), by idea:
``harness`` (launching runs, injecting faults, waiting, collecting), ``measure`` (figures
from what the runs left, and the projection) and ``report`` (docs/reliability.md from the
``report.md`` template, and the timeline plot)."""
