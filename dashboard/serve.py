"""The dashboard's server process: ``python -m dashboard.serve run dashboard/app.py [streamlit flags]``.

Runs Streamlit's own command line after three start-up savings, so that the first page is drawn soon after the
server starts (``benchmarks/dashboard_load.py`` measures it):

- a thread opens and analyzes the run the picker shows first (the newest under the root) while the server
  starts and the browser loads the page; the page then finds the analysis in ``dashboard.data``'s cache (it
  waits on the same lock if the thread is not done);
- Streamlit's scan of every installed distribution for custom-component manifests is skipped: the dashboard
  uses no custom components, and the scan reads the metadata of every installed package (~0.4 s here);
- Streamlit's check, when the first element of the first page is drawn, whether it was started from a Python
  prompt is skipped: it walks ``inspect.stack()`` (~0.3 s here, on the first page's way), and this process is a
  ``streamlit run``.
"""

from __future__ import annotations

import sys
import threading


def _warm() -> None:
    """Open and analyze the default run ahead of the first page; a failure is left for the page to report."""
    try:
        from dashboard import data
        from dashboard.paths import list_sources, root_from_env

        sources = list_sources(root_from_env())
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


def _skip_direct_run_check() -> None:
    # the check only prints "use streamlit run" when not run by `streamlit run`; mark it done (private name: an
    # older or newer Streamlit without it just pays the check)
    try:
        from streamlit import delta_generator
    except ImportError:
        return
    if hasattr(delta_generator, "_use_warning_has_been_displayed"):
        delta_generator._use_warning_has_been_displayed = True


def main() -> None:
    from streamlit.web import cli

    _skip_component_scan()
    _skip_direct_run_check()
    # Streamlit is imported before the thread starts: plotly's checks at Streamlit's import look pandas up in
    # sys.modules, where a pandas half-imported by another thread would be visible. The thread's reading and
    # analysis then overlap with the browser loading the page (another process), not with this import.
    threading.Thread(target=_warm, name="dtprobe-warm", daemon=True).start()
    sys.argv = ["streamlit", *sys.argv[1:]]
    cli.main(prog_name="streamlit")


if __name__ == "__main__":
    main()
