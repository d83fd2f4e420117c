"""Kernels page and PNG export in a real browser (Playwright driving Debian's /usr/bin/chromium) against the server
started with the exact command of `dtprobe dashboard`, on the foreign DLRM traces (8 ranks, V100, NCCL).

``load_trace_dir`` reduces the files in a process pool from a script thread of a server whose SIGTERM handler
(Streamlit's) only schedules a shutdown and returns: the pool must still end, or the page's script thread waits
for its workers for ever and the Kernels page never draws.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
from PIL import Image  # a Streamlit dependency
from playwright.sync_api import expect

from dtprobe.dashboard.export import PNG_MAGIC
from dtprobe.synthetic import write_synthetic_run
from test_browser_dashboard import DLRM, SCREENSHOTS, browser, dashboard_server, page, wait_drawn  # noqa: F401

DLRM_RANKS = 8
HTA_KERNEL_TIME_US = [13009, 18749, 11350, 18853, 16589, 16392, 11410, 10967]
HTA_IDLE_PCT = [49.34, 34.28, 62.08, 43.20, 53.57, 55.64, 61.80, 75.75]
"""HTA 0.5.0 on the same traces, per rank."""
FIRST_DRAW_MS = 120_000
"""Limit of a cold DLRM Kernels page's first draw: generous for a slow machine; a stalled pool never draws."""

# ------------------------------------------------------------------------------------------------ no browser


def test_trace_pool_finishes_in_a_process_whose_sigterm_handler_returns(tmp_path, repo_root):
    """What the server does: parse a trace folder with the process pool from a non-main thread of a process
    whose SIGTERM handler returns without exiting (Streamlit's); a pool that waits for its workers hangs here."""
    script = tmp_path / "pool_under_handler.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, threading
        from dtprobe.store.kineto import load_trace_dir

        if __name__ == "__main__":   # the pool's worker processes import this script as a module
            signal.signal(signal.SIGTERM, lambda *args: None)  # like Streamlit's: schedules a stop, returns
            for attempt in range(5):
                result = {{}}
                thread = threading.Thread(
                    target=lambda: result.update(run=load_trace_dir({str(DLRM)!r}, workers=2)), daemon=True)
                thread.start()
                thread.join(30)
                if thread.is_alive():  # exit now: a normal exit would wait for the stuck workers again
                    print(f"load_trace_dir hung on attempt {{attempt}}", flush=True)
                    os._exit(3)
                assert sorted(result["run"].ranks) == list(range({DLRM_RANKS}))
            print("finished")
    """))
    log = tmp_path / "pool_under_handler.log"
    with open(log, "w") as out:  # a file, not a pipe: stuck workers would hold a pipe open
        proc = subprocess.Popen([sys.executable, str(script)], cwd=repo_root, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.wait(180)
    finally:
        try:  # the script's session: also pool workers orphaned by os._exit
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    out = log.read_text()
    assert proc.returncode == 0, out
    assert out.strip().endswith("finished")


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def kernels_root(tmp_path_factory) -> Path:
    """A synthetic run (the newest: the server pre-loads it) and a copy of the DLRM traces (older), so the
    Kernels page parses the traces itself, in the page's script thread (which a stuck pool would stall)."""
    root = tmp_path_factory.mktemp("kernels_root")
    shutil.copytree(DLRM, root / "dlrm_8rank_v100")
    write_synthetic_run(root / "dp4_clean", num_ranks=4, num_steps=30)
    return root


@pytest.fixture(scope="module")
def server(kernels_root, dashboard_server):
    with dashboard_server(kernels_root, "dashboard-kernels-server.log") as running:
        yield running


def open_kernels(server, pg) -> None:
    pg.goto(f"{server['url']}/kernels?run=dlrm_8rank_v100")
    wait_drawn(pg, timeout_ms=FIRST_DRAW_MS)
    expect(pg.get_by_test_id("stException")).to_have_count(0)


# ------------------------------------------------------------------------------------------------ Kernels page


@pytest.mark.browser
def test_kernels_page_draws_the_dlrm_traces_for_all_8_ranks(server, page):
    t0 = time.monotonic()
    open_kernels(server, page)
    expect(page.get_by_test_id("stHeading").filter(has_text="Kernels")).to_be_visible()
    expect(page.get_by_text(f"Kineto trace folder: {DLRM_RANKS} ranks.")).to_be_visible()
    charts = page.get_by_test_id("stPlotlyChart")
    expect(charts).to_have_count(2)  # temporal breakdown + kernel types
    temporal = charts.nth(0)
    expect(temporal.locator(".gtitle")).to_have_text("Temporal breakdown per rank")
    expect(temporal.locator(".barlayer .trace")).to_have_count(3)  # compute, non-compute, idle
    assert temporal.locator(".xtick text").all_text_contents() == [f"rank {r}" for r in range(DLRM_RANKS)]
    types = charts.nth(1)
    expect(types.locator(".gtitle")).to_have_text("Kernel time by type")
    legend = " ".join(types.locator(".legendtext").all_text_contents())
    assert "COMMUNICATION" in legend and "COMPUTATION" in legend
    # the per-rank table (a hidden <table> mirrors the canvas grid with raw values) agrees with HTA 0.5.0
    table = page.get_by_test_id("stMain").get_by_test_id("stDataFrame")
    expect(table).to_have_count(1)
    rows = table.locator("table tbody tr")
    expect(rows).to_have_count(DLRM_RANKS)
    header = table.locator("table th").all_text_contents()
    cells = [dict(zip(header, rows.nth(i).locator("td").all_text_contents())) for i in range(DLRM_RANKS)]
    assert [int(c["rank"]) for c in cells] == list(range(DLRM_RANKS))
    assert [int(c["kernel_time_us"]) for c in cells] == HTA_KERNEL_TIME_US
    assert [float(c["idle_frac"]) for c in cells] == pytest.approx([p / 100 for p in HTA_IDLE_PCT], abs=1e-4)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "kernels_dlrm.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 40_000
    assert time.monotonic() - t0 < FIRST_DRAW_MS / 1000


# ------------------------------------------------------------------------------------------------ PNG export


def png_facts(data: bytes) -> dict:
    """Check a PNG's structure (signature, every chunk's CRC, IHDR first, IEND last, IDAT inflating to exactly
    height scanlines) and return width, height, color type and the inflated image bytes."""
    assert data[:8] == PNG_MAGIC, f"not a PNG signature: {data[:8]!r}"
    pos, chunks, idat = 8, [], b""
    while pos < len(data):
        length, ctype = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(ctype + body) == crc, f"bad CRC in chunk {ctype!r}"
        chunks.append(ctype)
        if ctype == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
        elif ctype == b"IDAT":
            idat += body
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks, chunks
    pixels = zlib.decompress(idat)
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    assert depth == 8
    assert len(pixels) == height * (1 + width * channels)  # one filter byte + one row per scanline
    return {"width": width, "height": height, "color": color, "pixels": pixels}


@pytest.mark.browser
def test_png_button_downloads_a_valid_png_of_the_chart(server, page, tmp_path):
    open_kernels(server, page)
    button = page.locator(".st-key-kernels_temporal_png").get_by_role("button", name=re.compile("PNG"))
    expect(button).to_be_visible()
    with page.expect_download(timeout=120_000) as download_info:  # the first export starts kaleido's chromium
        button.click()
    download = download_info.value
    assert download.failure() is None
    assert download.suggested_filename == "kernels_temporal.png"
    saved = tmp_path / download.suggested_filename
    download.save_as(saved)
    data = saved.read_bytes()
    assert 10_000 < len(data) < 5_000_000, len(data)
    png = png_facts(data)
    assert (png["width"], png["height"]) == (1200, 360)  # export width; the chart's own height
    assert png["color"] in (2, 6)  # RGB(A)
    # colored as on screen: the charts' palette (Streamlit's) fills the compute / non-compute / idle bars, and
    # nothing left for Streamlit's frontend to resolve comes out near-black
    image = Image.open(saved).convert("RGB")
    share = {color: count / (image.width * image.height) for count, color in image.getcolors(1 << 24)}
    for hex_color in ("#0068c9", "#83c9ff", "#ff2b2b"):
        rgb = tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
        assert share.get(rgb, 0) > 0.02, f"{hex_color} covers {share.get(rgb, 0):.2%} of the PNG"
    dark = sum(v for (r, g, b), v in share.items() if max(r, g, b) < 40)
    assert dark < 0.02, f"{dark:.1%} of the PNG is near-black"
    expect(page.get_by_test_id("stException")).to_have_count(0)


def test_export_draws_a_copy_with_the_export_template_and_the_charts_palette():
    """In the server, plotly's default template is Streamlit's, whose colors only Streamlit's frontend resolves:
    the export draws a copy with its own template, and the charts set their trace colors themselves (no kaleido
    needed to check this)."""
    import pandas as pd
    import plotly.io as pio
    import streamlit  # noqa: F401  (makes Streamlit's template plotly's default, as in the server)

    from dtprobe.dashboard import charts
    from dtprobe.dashboard.export import EXPORT_TEMPLATE, as_drawn

    assert pio.templates.default == "streamlit"
    temporal = pd.DataFrame({"rank": [0, 1], "compute_frac": [0.1, 0.2], "non_compute_frac": [0.3, 0.3],
                             "idle_frac": [0.6, 0.5]})
    steps = pd.DataFrame({"rank": [0, 0, 1, 1], "step": [0, 1, 0, 1], "start_ns": [0, 0, 0, 0],
                          "end_ns": [1e6, 2e6, 3e6, 4e6]})
    for fig in (charts.temporal_breakdown(temporal), charts.step_time_by_rank(steps)):
        before = fig.to_json()
        drawn = as_drawn(fig)
        assert drawn.layout.template == EXPORT_TEMPLATE and drawn.layout.template.layout.paper_bgcolor == "white"
        assert not re.search(r"#0000[0-4][0-9]", drawn.to_json())  # nothing left that only Streamlit resolves
        assert list(drawn.layout.template.layout.colorway[:3]) == charts.PALETTE[:3]
        assert drawn.layout.yaxis.automargin is True and drawn.layout.xaxis.automargin is True
        assert fig.to_json() == before  # the page's figure is untouched
    assert [t.line.color for t in charts.step_time_by_rank(steps).data] == charts.PALETTE[:2]