"""The dashboard's server process: ``python -m dashboard.serve run dashboard/app.py [streamlit flags]``.

Runs Streamlit's own command line after two start-up savings, so that the first page is drawn soon after the
server starts (``benchmarks/dashboard_load.py`` measures it):

- a thread opens and analyzes the run the picker shows first (the newest under the root) and imports the
  charting stack while the server starts and the browser loads the page; the page then finds the analysis in
  ``dashboard.data``'s cache (it waits on the same lock if the thread is not done);
- Streamlit's scan of every installed distribution for custom-component manifests is skipped: the dashboard
  uses no custom components, and the scan reads the metadata of every installed package (~0.4 s here).
"""

from __future__ import annotations

import sys
import threading


def _warm() -> None:
    """Analyze the default run ahead of the first page; a failure is left for the page to report readably."""
    try:
        from dashboard import charts  # noqa: F401  (plotly: every page imports it)
        from dashboard import data
        from dashboard.paths import root_from_env

        sources = data.load_sources(root_from_env())
        if sources:
            data.warm(sources[0])
    except Exception as exc:  # noqa: BLE001 - the page shows the same error where the user can act on it
        print(f"dtprobe dashboard: pre-loading the newest run failed ({exc}); the page will say why.",
              file=sys.stderr, flush=True)


def _skip_component_scan() -> None:
    try:
        from streamlit.components.v2 import manifest_scanner
    except ImportError:  # an older Streamlit without v2 components: nothing to skip
        return
    manifest_scanner.scan_component_manifests = lambda *args, **kwargs: []


def main() -> None:
    # Import the shared third-party stack on this thread first: a module half-imported by another thread is
    # visible in sys.modules, and plotly's optional pandas check would see it half-built.
    import pandas  # noqa: F401
    from streamlit.web import cli

    _skip_component_scan()
    threading.Thread(target=_warm, name="dtprobe-warm", daemon=True).start()
    sys.argv = ["streamlit", *sys.argv[1:]]
    cli.main(prog_name="streamlit")


if __name__ == "__main__":
    main()
