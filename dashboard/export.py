"""PNG export of plotly figures with kaleido (Debian's chromium), one browser kept for the process; pure, no
streamlit (the pages' download buttons call ``figure_png`` only when clicked).

A figure is exported with ``EXPORT_TEMPLATE`` (plotly's white template with the charts' palette) in place of
whatever template it was made under: inside the dashboard that is Streamlit's, whose colors only Streamlit's
frontend resolves. Trace colors are set by ``dtprobe.dashboard.charts`` itself, so they match the page.
"""

from __future__ import annotations

import atexit
import threading
import warnings

import plotly.graph_objects as go
import plotly.io as pio

from dtprobe.dashboard.charts import PALETTE

_LOCK = threading.Lock()
_SERVER = {"started": False}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
"""First bytes of every PNG file."""

EXPORT_TEMPLATE = go.layout.Template(pio.templates["plotly_white"])
"""How an exported figure is drawn: plotly's white template, the charts' palette for traces without a color."""
EXPORT_TEMPLATE.layout.colorway = PALETTE


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


def as_drawn(fig: go.Figure) -> go.Figure:
    """A copy of ``fig`` drawn with ``EXPORT_TEMPLATE`` and axis automargins on, as a page shows it (``fig``
    itself is left untouched)."""
    drawn = go.Figure(fig)
    drawn.update_layout(template=EXPORT_TEMPLATE)
    drawn.update_xaxes(automargin=True)
    drawn.update_yaxes(automargin=True)
    return drawn


def figure_png(fig: go.Figure, *, width: int = 1200) -> bytes:
    """``fig`` rendered as a PNG, colored as on screen (``width`` px wide, the figure's own height or 500 px)."""
    height = int(fig.layout.height or 500)
    fig = as_drawn(fig)
    with _LOCK:
        _ensure_server()
        with warnings.catch_warnings():  # plotly: "kopts ignored if using a server" (we use one on purpose)
            warnings.simplefilter("ignore", UserWarning)
            data = fig.to_image(format="png", width=width, height=height)
    assert data.startswith(PNG_MAGIC), "kaleido returned something that is not a PNG"
    return data
