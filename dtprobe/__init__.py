"""dtprobe: profiling and diagnostics for distributed PyTorch training. ``dtprobe.attach`` is the public API."""

from __future__ import annotations

__version__ = "0.1.0"


def attach(*args, **kwargs):
    """Instrument the current torchrun worker; see ``dtprobe.collectors.attach.attach`` (imported lazily: torch is heavy)."""
    from dtprobe.collectors.attach import attach as _attach

    return _attach(*args, **kwargs)


_record_sink = None
"""Set by ``dtprobe launch``'s worker (``dtprobe.runtime.launch_worker``) to its step tracker's ``record``."""


def record(*, loss=None, tokens=None) -> None:
    """Add this step's ``loss`` (a float or a tensor; several calls in a step are averaged) and ``tokens`` (summed)
    under ``dtprobe launch``; a no-op anywhere else, so a script can keep the call when run without dtprobe."""
    if _record_sink is not None:
        _record_sink(loss=loss, tokens=tokens)
