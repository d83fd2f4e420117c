"""dtprobe: profiling and diagnostics for distributed PyTorch training. ``dtprobe.attach`` is the public API."""

from __future__ import annotations

__version__ = "0.1.0"


def attach(*args, **kwargs):
    """Instrument the current torchrun worker; see ``dtprobe.collectors.attach.attach`` (imported lazily: torch is heavy)."""
    from dtprobe.collectors.attach import attach as _attach

    return _attach(*args, **kwargs)
