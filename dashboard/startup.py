"""Streamlit's plotly template, set up when the first chart is made instead of at Streamlit's import.

Importing Streamlit imports plotly and builds its ``streamlit`` template (0.2-0.3 s here) whether or not a page
ever draws a chart; the Overview draws none. ``dtprobe.dashboard.serve`` calls ``defer_plotly_theme`` before it imports
Streamlit, and ``dtprobe.dashboard.charts`` calls ``plotly_theme`` when it is imported, before any figure is made (the
template is plotly's default from then on, which figures take when they are made). In a process that did not
defer it (``streamlit run``, tests) ``plotly_theme`` does nothing.

A module of its own, not ``dtprobe.dashboard.serve``: that one runs as ``__main__``, and its state would not be the one
the pages import.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable

THEME_MODULE = "streamlit.elements.lib.streamlit_plotly_theme"
"""Where Streamlit (1.40 ... 1.67 at least) defines ``configure_streamlit_plotly_theme``, called at its import."""

_DEFERRED: dict[str, Callable[[], None] | None] = {"configure": None}
_LOCK = threading.Lock()


class _DeferTheme(importlib.abc.MetaPathFinder):
    """Finds ``THEME_MODULE`` once and swaps its set-up function for a no-op right after it is executed."""

    def find_spec(self, name, path, target=None):
        if name != THEME_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            configure = getattr(module, "configure_streamlit_plotly_theme", None)
            if callable(configure):
                _DEFERRED["configure"] = configure
                module.configure_streamlit_plotly_theme = lambda: None

        spec.loader.exec_module = exec_module
        return spec


def defer_plotly_theme() -> None:
    """Make Streamlit's import skip its plotly template set-up (call before Streamlit is imported; with another
    Streamlit layout nothing is skipped)."""
    if THEME_MODULE not in sys.modules and not any(isinstance(f, _DeferTheme) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferTheme())


def plotly_theme() -> None:
    """Set Streamlit's plotly template up now if its import skipped it (idempotent, thread-safe)."""
    with _LOCK:
        configure, _DEFERRED["configure"] = _DEFERRED["configure"], None
        if configure is not None:
            configure()
