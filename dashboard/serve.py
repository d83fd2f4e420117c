"""The dashboard's server process: ``python -m dtprobe.dashboard.serve run dashboard/app.py [streamlit flags]``.

Runs Streamlit's own command line after four start-up savings, so that the first page is drawn soon after the
server starts (``benchmarks/dashboard_load.py`` measures it):

- before anything else it starts ``python -m dtprobe.dashboard.summary``, which opens and analyzes the run the picker
  shows first (the newest under the root) on the machine's other core while this process imports Streamlit and
  the browser loads the page; the first Overview is drawn from the summary it prints (``dtprobe.dashboard.data``), and
  this process analyzes the run itself once that page is sent. Analyzing here instead, in a thread, shared the
  one interpreter lock with the server sending the page's ~100 script files;
- Streamlit's plotly template is set up when the first chart is made, not at Streamlit's import
  (``dtprobe.dashboard.startup``);
- Streamlit's scan of every installed distribution for custom-component manifests is skipped: the dashboard
  uses no custom components, and the scan reads the metadata of every installed package (~0.4 s here);
- Streamlit's check, when the first element of the first page is drawn, whether it was started from a Python
  prompt is skipped: it walks ``inspect.stack()`` (~0.3 s here, on the first page's way), and this process is a
  ``streamlit run``.
"""

from __future__ import annotations

import subprocess
import sys
import threading

SUMMARY_TIMEOUT_S = 300.0
"""The summary child is stopped after this long (pages stop waiting for it long before: ``data.SUMMARY_WAIT_S``)."""


def _newest_source() -> str | None:
    """The folder of the run or trace folder the picker shows first, or None (no root, nothing under it)."""
    from dtprobe.dashboard.paths import list_sources, root_from_env
    from dtprobe.store.errors import ConfigError

    try:
        sources = list_sources(root_from_env())
    except (ConfigError, OSError):  # the page says what is wrong with the root
        return None
    return str(sources[0].path) if sources else None


def _start_summary(path: str) -> subprocess.Popen | None:
    try:
        return subprocess.Popen([sys.executable, "-m", "dtprobe.dashboard.summary", path], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        print(f"dtprobe dashboard: could not start the summary process ({exc}); pages analyze in the server.",
              file=sys.stderr, flush=True)
        return None


def _collect_summary(path: str, proc: subprocess.Popen) -> None:
    """Hand the child's summary of ``path`` to ``dtprobe.dashboard.data``; a child that fails leaves the analysis to the
    page, which reports the same error where the user can act on it."""
    from dtprobe.dashboard import data, summary

    overview = None
    try:
        out, err = proc.communicate(timeout=SUMMARY_TIMEOUT_S)
        if proc.returncode == 0 and out:
            overview = summary.Overview.from_json(out)
        elif proc.returncode not in (0, 2):  # not a refusal of the data (the page shows those): a failure
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            print(f"dtprobe dashboard: the summary process failed (exit {proc.returncode}); pages analyze in the "
                  f"server. " + " | ".join(tail), file=sys.stderr, flush=True)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    except ValueError as exc:  # not a summary document: a version mismatch or a stray print
        print(f"dtprobe dashboard: ignoring the summary process's output ({exc}).", file=sys.stderr, flush=True)
    finally:
        data.put_summary(path, overview)


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
    path = _newest_source()
    proc = _start_summary(path) if path is not None else None  # first: it runs while Streamlit is imported below
    from dtprobe.dashboard import startup

    startup.defer_plotly_theme()
    from streamlit.web import cli

    from dtprobe.dashboard import data

    _skip_component_scan()
    _skip_direct_run_check()
    if proc is not None:
        data.expect_summary(path)  # before the server starts: no page can run earlier
        threading.Thread(target=_collect_summary, args=(path, proc), name="dtprobe-summary", daemon=True).start()
    sys.argv = ["streamlit", *sys.argv[1:]]
    cli.main(prog_name="streamlit")


if __name__ == "__main__":
    main()
