"""PNG export of plotly figures with kaleido (Debian's chromium), one browser kept for the process; pure, no
streamlit (the pages' download buttons call ``figure_png`` only when clicked)."""

from __future__ import annotations

import atexit
import threading
import warnings

import plotly.graph_objects as go

_LOCK = threading.Lock()
_SERVER = {"started": False}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
"""First bytes of every PNG file."""


def _ensure_server() -> None:
    import kaleido

    if not _SERVER["started"]:
        kaleido.start_sync_server(silence_warnings=True)
        _SERVER["started"] = True
        atexit.register(stop)


def stop() -> None:
    """Stop the kaleido browser if one was started (idempotent)."""
    import kaleido

    with _LOCK:
        if _SERVER["started"]:
            kaleido.stop_sync_server(silence_warnings=True)
            _SERVER["started"] = False


def figure_png(fig: go.Figure, *, width: int = 1200) -> bytes:
    """``fig`` rendered as a PNG (``width`` px wide, the figure's own height or 500 px)."""
    height = int(fig.layout.height or 500)
    with _LOCK:
        _ensure_server()
        with warnings.catch_warnings():  # plotly: "kopts ignored if using a server" (we use one on purpose)
            warnings.simplefilter("ignore", UserWarning)
            data = fig.to_image(format="png", width=width, height=height)
    assert data.startswith(PNG_MAGIC), "kaleido returned something that is not a PNG"
    return data
