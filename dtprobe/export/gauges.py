"""The Prometheus gauges of ``dtprobe serve-metrics``: names, help texts and labels, defined once; read by
``dtprobe.export.prometheus`` and the command's ``--help`` (a leaf: no imports, so ``dtprobe --help`` stays fast)."""

from __future__ import annotations

METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dtprobe_step_time_seconds": ("Duration of the rank's newest finished step.", ("run", "rank")),
    "dtprobe_tokens_per_second": ("Median tokens per second of the job over the analysed steps.", ("run",)),
    "dtprobe_lateness_ratio": ("Median arrival lateness at the group's collectives as a share of the step, in the "
                               "rank's worst window of steps (the STRAGGLER metric).", ("run", "rank", "pg")),
    "dtprobe_exposed_comm_ratio": ("Exposed communication net of straggler wait as a share of the step.",
                                   ("run", "rank")),
    "dtprobe_findings": ("Findings of this code and severity.", ("run", "code", "severity")),
    "dtprobe_last_step": ("Number of the rank's newest finished step.", ("run", "rank")),
}
"""Gauge name -> (help text, label names)."""
DEFAULT_WINDOW_STEPS = 100
"""Newest steps of a running run that are analysed at each scrape."""
