"""The dashboard's server process: ``python -m dtprobe.dashboard.serve run dashboard/app.py [streamlit flags]``.

Streamlit's own command line (``streamlit.web.cli``, what ``streamlit run`` calls), after starting one thread that
loads what the first page shows: the Overview of the source the run picker shows first (the newest under the
root), through ``dtprobe.dashboard.data``'s shared cache. It runs while Streamlit starts and the browser loads
the page, so the first Overview finds a running run already analyzed (or a finished run's stored summary read)
instead of starting then.
"""

from __future__ import annotations

import sys
import threading


def _warm_first_page() -> None:
    """Load the Overview of the newest source under the root into the shared cache; any problem with the root or
    the data is left for the page to report, where the user can act on it."""
    from dtprobe.dashboard import data
    from dtprobe.dashboard.paths import list_sources, root_from_env
    from dtprobe.store.errors import ConfigError, TraceError

    try:
        sources = list_sources(root_from_env())
        if not sources:
            return
        if data.summary_store.is_finished(sources[0].path):
            data.finished_overview(sources[0])   # a large run without a summary: analyzed behind its first draw
        else:
            data.load_overview(sources[0])
    except (ConfigError, TraceError, OSError):
        pass
    import plotly.graph_objects  # noqa: F401  (the Overview's last element, common.preload_chart_library)


def main() -> None:
    threading.Thread(target=_warm_first_page, name="dtprobe-first-page", daemon=True).start()
    from streamlit.web import cli

    sys.argv = ["streamlit", *sys.argv[1:]]
    cli.main(prog_name="streamlit")


if __name__ == "__main__":
    main()
