"""PNG export of plotly figures with kaleido (Debian's chromium), one browser kept for the process; pure, no
streamlit (the pages' download buttons call ``figure_png`` only when clicked).

Inside the dashboard, plotly's default template is Streamlit's ``streamlit`` template, whose colors are
placeholders (``#000001`` ... ``#000040``) that Streamlit's frontend swaps for the theme's colors when it draws
a chart; it also turns on axis automargins. Rendered as they are, every bar and line comes out near-black and
long tick labels are clipped, so ``figure_png`` first makes the same substitutions (Streamlit's light theme).
"""

from __future__ import annotations

import atexit
import json
import re
import threading
import warnings

import plotly.graph_objects as go
import plotly.io as pio

_LOCK = threading.Lock()
_SERVER = {"started": False}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
"""First bytes of every PNG file."""

_CATEGORICAL = ["#0068c9", "#83c9ff", "#ff2b2b", "#ffabab", "#29b09d", "#7defa1", "#ff8700", "#ffd16a", "#6d3fc0",
                "#d5dae5"]
_SEQUENTIAL = ["#e4f5ff", "#c7ebff", "#a6dcff", "#83c9ff", "#60b4ff", "#3d9df3", "#1c83e1", "#0068c9", "#0054a3",
               "#004280"]
_DIVERGING = ["#7d353b", "#bd4043", "#ff4b4b", "#ff8c8c", "#ffc7c7", "#a6dcff", "#60b4ff", "#1c83e1", "#0054a3",
              "#004280"]
STREAMLIT_COLORS = {
    **{f"#{i + 1:06d}": c for i, c in enumerate(_CATEGORICAL)},
    **{f"#{i + 11:06d}": c for i, c in enumerate(_SEQUENTIAL)},
    **{f"#{i + 21:06d}": c for i, c in enumerate(_DIVERGING)},
    "#000032": "#29b09d", "#000033": "#ff2b2b", "#000034": "#0068c9",  # waterfall increasing/decreasing/total
    "#000035": "#e6eaf1", "#000036": "#808495", "#000037": "#262730",  # grid, faded text, text
    "#000038": "#ffffff", "#000039": "rgba(47, 45, 43, 0.1)", "#000040": "#fbfbfb",  # background, faded, mix
}
"""Streamlit 1.67's color placeholders (``streamlit/elements/lib/streamlit_plotly_theme.py``) -> the light theme's
colors its frontend puts in their place (``PlotlyChart`` replaceAll, ``chartCategoricalColors`` & co.)."""
_PLACEHOLDER_RE = re.compile(r'"(#0000[0-4][0-9])"')


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
    """A copy of ``fig`` as Streamlit draws it: theme colors in place of the template's placeholders, axis
    automargins on (``fig`` itself is left untouched)."""
    text = _PLACEHOLDER_RE.sub(lambda m: f'"{STREAMLIT_COLORS.get(m.group(1), m.group(1))}"', pio.to_json(fig))
    drawn = go.Figure(json.loads(text))
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
