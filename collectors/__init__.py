"""Telemetry emitters into the run store: collectives (recording process groups), steps, devices, profiler
windows. ``dtprobe.collectors.attach.attach`` (re-exported as ``dtprobe.attach``) is the entry point."""

from __future__ import annotations


def register_backends() -> None:
    """Register the recording backends ``dtprobe_gloo`` / ``dtprobe_nccl`` (imports torch.distributed), for a script
    that names one in its own ``init_process_group``; ``dtprobe.attach`` registers them itself."""
    from dtprobe.collectors.pg_wrapper import register_backends as _register

    _register()
