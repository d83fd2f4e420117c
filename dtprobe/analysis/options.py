"""``AnalysisOptions``: the thresholds and assumptions of the analysis a user may change; read by the facade,
``dtprobe analyze`` (its flags) and the stored Overview (its cache key)."""

from __future__ import annotations

from dataclasses import dataclass

from dtprobe.analysis.checkpoints import DEFAULT_MTBF_HOURS


@dataclass(frozen=True, kw_only=True)
class AnalysisOptions:
    """Thresholds and assumptions of the analysis (the detectors' keyword arguments that users may change)."""

    window_steps: int = 20
    """Sliding window (steps) over which a straggler must persist."""
    min_lateness_frac: float = 0.05
    """A straggler's median lateness over the window (arrival minus its peers' median), as a share of the step."""
    min_positive_frac: float = 0.8
    """Share of the window's steps in which a straggler must arrive after its peers' median."""
    skip_first_steps: int = 1
    """Warm-up steps left out of step-time based metrics (DDP rebuilds buckets on step 0)."""
    mtbf_hours: float = DEFAULT_MTBF_HOURS
    """Mean time between failures for the Young/Daly checkpoint interval (default one failure a day)."""
    hang_timeout_s: float = 60.0
    """While a run is running, a collective some members have waited at this long is a hang."""
    peak_busbw_gbps: float | None = None
    """Link peak bus bandwidth (Gb/s) to judge large collectives against; None skips that check."""
    min_exposed_frac: float = 0.10
    """EXPOSED_COMM threshold (share of the step)."""
    min_bubble_frac: float = 0.10
    """PIPELINE_BUBBLE threshold (mean idle share of the pipeline window)."""

    def __post_init__(self) -> None:
        if self.window_steps < 1 or not 0 < self.min_positive_frac <= 1 or self.mtbf_hours <= 0:
            raise ValueError(f"invalid analysis options: window_steps={self.window_steps} (>= 1), "
                             f"min_positive_frac={self.min_positive_frac} (0..1], mtbf_hours={self.mtbf_hours} (> 0)")
