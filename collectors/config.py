"""``CollectConfig``: what the probe records (collectives, devices, profiler windows); read by ``dtprobe.collectors.attach``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from dtprobe.store.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class CollectConfig:
    """Telemetry switches for one run. Every field is also a keyword of ``dtprobe.attach``."""

    enabled: bool = True
    """False makes every probe call a no-op (no files, no wrapper backend): the baseline of overhead tests."""
    collectives: bool = True
    """Record every collective of the default group and of the groups created after attach (gloo or NCCL; see
    ``dtprobe.collectors.attach``)."""
    collective_timing: str = "wait"
    """How a collective's completion (``end_ns``) is seen on the host: ``"wait"`` (the done-callback of the
    work's future, i.e. when the backend finished it; for works without a future, gloo send/recv and
    reduce-scatter, when ``wait()`` returns) or ``"enqueue"`` (rows written at the call, ``end_ns`` null:
    cheaper when a step issues many small collectives)."""
    nccl_timing: bool = True
    """On NCCL, fill ``start_ns``/``end_ns`` from the completion hook when ``TORCH_NCCL_ENABLE_TIMING=1``."""
    devices: bool = True
    """Sample devices (NVML when present, else this process's CPU/RSS and the host load) in a thread."""
    device_interval_s: float = 1.0
    """Seconds between device samples; one sample is also taken at attach and at close."""
    profile_steps: tuple[int, int] | None = None
    """Inclusive step window ``(first, last)`` traced with torch.profiler into ``traces/steps<first>-<last>/``."""
    profile_record_shapes: bool = True
    """Record input shapes in the profiler window (HTA and Perfetto show them; costs a little more)."""
    clock_rounds: int = 8
    """Ping-pong rounds with rank 0 when measuring the clock offset (at attach and each re-measurement); the
    min-RTT round is kept."""
    clock_interval_s: float = 60.0
    """Seconds between re-measurements of the clock offset to rank 0 by a background thread over a gloo group of
    its own (rows of the ``clock`` table; the reader interpolates them, following host clocks that drift or are
    stepped by NTP); 0 measures at attach only. Ranks on rank 0's machine share its clock and are never measured."""
    flush_interval_s: float = 0.1
    """Seconds between flushes of buffered rows to ``events/`` by a background thread (also at close): the loss
    bound. A rank killed by SIGKILL loses at most the rows of its last ``flush_interval_s``; a collective it
    waited in for more than ``2 * flush_interval_s`` is on disk (table ``pending``), even when its training
    thread was blocked."""
    close_on_sigterm: bool = True
    """Close the probe when the worker gets SIGTERM (torchrun stopping the surviving ranks): its in-flight
    collectives and a ``lifecycle`` close row (reason ``"SIGTERM"``) are written, also while the main thread is
    blocked in a collective; then the process dies of SIGTERM as it would have, or, if a Python SIGTERM handler
    was installed before ``attach``, that handler runs and decides. Installed only from the main thread
    (``dtprobe.collectors.sigterm``)."""

    def __post_init__(self) -> None:
        if self.collective_timing not in ("wait", "enqueue"):
            raise ConfigError(
                f"collect.collective_timing = {self.collective_timing!r}; use 'wait' (completion seen on the "
                f"host) or 'enqueue' (no completion time).")
        if not self.device_interval_s > 0:
            raise ConfigError(
                f"collect.device_interval_s = {self.device_interval_s}; it must be > 0 seconds "
                f"(e.g. 1.0), or set devices=False to turn the sampler off.")
        if self.profile_steps is not None:
            window = tuple(self.profile_steps)
            if (len(window) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in window)
                    or window[0] < 0 or window[1] < window[0]):
                raise ConfigError(
                    f"collect.profile_steps = {self.profile_steps!r}; give two step numbers (first, last) with "
                    f"0 <= first <= last, e.g. (10, 11), or None for no profiler window.")
            object.__setattr__(self, "profile_steps", (int(window[0]), int(window[1])))
        if self.clock_rounds < 1:
            raise ConfigError(f"collect.clock_rounds = {self.clock_rounds}; it must be >= 1 (8 is a good value).")
        if not self.clock_interval_s >= 0:
            raise ConfigError(f"collect.clock_interval_s = {self.clock_interval_s}; it must be >= 0 seconds "
                              f"(60 is a good value; 0 measures the clock offset at attach only).")
        if not self.flush_interval_s > 0:
            raise ConfigError(f"collect.flush_interval_s = {self.flush_interval_s}; it must be > 0 seconds.")
        if not self.enabled and (self.profile_steps is not None):
            warnings.warn("collect.profile_steps has no effect with enabled=False: nothing is recorded.",
                          stacklevel=3)
