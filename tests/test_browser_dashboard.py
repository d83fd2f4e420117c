"""Dashboard in a real browser (Playwright driving Debian's /usr/bin/chromium) against the server started with
the exact flags of `dtprobe dashboard`: loopback only, foreign Host refused, live step count advancing on a
running `dtprobe run` job without a reload, a STRAGGLER finding link landing on the Stragglers page with the
culprit marked, and a screenshot of every page (test-artifacts/screenshots/)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from playwright.sync_api import expect, sync_playwright

from dtprobe.dashboard.nav import PAGES
from dtprobe.dashboard.paths import ROOT_ENV
from dtprobe.summary_store import CACHE_ENV
from dtprobe.synthetic import write_synthetic_run
from dtprobe.commands.dashboard import APP, streamlit_argv

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = REPO / "test-artifacts" / "screenshots"
DLRM = REPO / "tests/data/traces/dlrm_8rank_v100"
TIMEOUT_MS = 90_000
STRAGGLER_RANK = 2



@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dash_root")
    write_synthetic_run(root / "dp4_straggler", num_ranks=4, num_steps=40, straggler_rank=STRAGGLER_RANK)
    write_synthetic_run(root / "dp4_clean", num_ranks=4, num_steps=30)
    shutil.copytree(DLRM, root / "dlrm_8rank_v100")
    return root


def kill_tree(pid: int) -> None:
    """Kill ``pid`` and every process it started (by PID), e.g. kaleido's chromium left by a hard kill."""
    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="session")
def dashboard_server(child_env, free_port, repo_root):
    """``with dashboard_server(root, log_name, **env) as running``: the dashboard served on ``root`` with the exact
    command of `dtprobe dashboard` on a free loopback port (``env`` added to the child's environment); stopped
    (with every process it started, by PID) on exit."""
    @contextlib.contextmanager
    def serve(root: Path, log_name: str, **env: str):
        user_cache = root.parent / f"{root.name}-user-cache"  # summaries the server makes: not the user's cache
        with _served(repo_root / "test-artifacts" / log_name, port=free_port(),
                     env=child_env(**{ROOT_ENV: str(root), CACHE_ENV: str(user_cache)}, **env)) as running:
            yield running
    return serve


@contextlib.contextmanager
def _served(log: Path, *, port: int, env: dict[str, str]):
    """The server started with ``env``, logging to ``log``; see ``dashboard_server``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(streamlit_argv(host="127.0.0.1", port=port), env=env, cwd=APP.parent, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"server exited:\n{log.read_text()}"
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"server not healthy after 90 s:\n{log.read_text()}"
            time.sleep(0.2)
        yield {"url": url, "port": port, "proc": proc, "log": log}
    finally:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait(5)
        for child in children:  # kaleido's chromium, pool workers: must not outlive the server
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                kill_tree(child.pid)


@pytest.fixture(scope="module")
def server(root, dashboard_server):
    with dashboard_server(root, "dashboard-server.log", DTPROBE_REFRESH_S="1") as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: install it with `bash scripts/install.sh --dev`"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1500, "height": 1100})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    expect.set_options(timeout=TIMEOUT_MS)
    yield pg
    context.close()


def wait_drawn(pg, *, charts: bool = True, timeout_ms: int = 300_000) -> None:
    """Wait until the script finished and every element (and plotly chart) is drawn; the first wait is long
    because a cold trace folder is parsed and analysed before anything draws."""
    expect(pg.get_by_test_id("stHeading").first).to_be_visible(timeout=timeout_ms)
    expect(pg.get_by_test_id("stStatusWidget")).to_have_count(0, timeout=timeout_ms)
    expect(pg.get_by_test_id("stSkeleton")).to_have_count(0)
    if charts and pg.get_by_test_id("stPlotlyChart").count():
        expect(pg.locator("[data-testid=stPlotlyChart] .main-svg").first).to_be_visible()


def metric(pg, label: str):
    return pg.get_by_test_id("stMetric").filter(has=pg.get_by_text(label, exact=True)).get_by_test_id("stMetricValue")


# ------------------------------------------------------------------------------------------------ security


def test_server_listens_on_loopback_only_and_refuses_a_foreign_host(server):
    listening = [c.laddr.ip for c in psutil.Process(server["proc"].pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening == ["127.0.0.1"]

    def upgrade(host: str) -> str:
        with socket.create_connection(("127.0.0.1", server["port"]), timeout=20) as c:
            c.sendall((f"GET /_stcore/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                       f"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                       f"Sec-WebSocket-Version: 13\r\nOrigin: http://{host}\r\n\r\n").encode())
            return c.recv(200).decode(errors="replace").splitlines()[0]

    assert " 403 " in upgrade(f"evil.example:{server['port']}")  # DNS rebinding: refused by allowedHosts
    assert " 101 " in upgrade(f"127.0.0.1:{server['port']}")


# ------------------------------------------------------------------------------------------------ drill down


def test_clicking_a_straggler_finding_lands_on_stragglers_with_the_rank_marked(server, page):
    page.goto(f"{server['url']}/?run=dp4_straggler")
    wait_drawn(page)
    expect(page.get_by_text("Unhealthy")).to_be_visible()
    page.get_by_role("link", name="Open evidence for STRAGGLER").click()
    expect(page).to_have_url(re.compile(rf"/stragglers\?.*ranks={STRAGGLER_RANK}"))
    expect(page.get_by_test_id("stHeading").filter(has_text="Stragglers")).to_be_visible()
    marked = page.get_by_test_id("stMarkdown").filter(has_text="Marked:")
    expect(marked).to_contain_text(f"rank {STRAGGLER_RANK} (from the finding link)")
    wait_drawn(page)
    heatmap = page.locator(".st-key-stragglers_heatmap").get_by_test_id("stPlotlyChart")
    expect(heatmap.locator(".shapelayer path")).to_have_count(1)  # the box around the culprit's row
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "stragglers_from_finding_link.png"), full_page=True)


# ------------------------------------------------------------------------------------------------ screenshots


@pytest.mark.parametrize("spec", PAGES, ids=lambda s: s.url_path)
def test_screenshot_of_every_page(server, page, spec):
    # Kernels on the foreign DLRM traces (8 V100 ranks); DLRM on the other pages is covered by the AppTest suite
    run = "dlrm_8rank_v100" if spec.url_path == "kernels" else "dp4_straggler"
    path = "" if spec.default else spec.url_path
    outside: list[str] = []  # the pages must not fetch anything from elsewhere (fonts, icons, telemetry)
    page.on("request", lambda request: None if request.url.startswith((server["url"], "data:", "blob:"))
            else outside.append(request.url))
    page.goto(f"{server['url']}/{path}?run={run}")
    wait_drawn(page)
    expect(page.get_by_test_id("stHeading").filter(has_text=spec.title).first).to_be_visible()
    expect(page.get_by_test_id("stException")).to_have_count(0)
    assert not outside, f"{spec.title} fetched from outside the dashboard's server: {outside}"
    if spec.url_path == "kernels":  # temporal breakdown: 3 stacked shares for each of the 8 ranks, + kernel types
        expect(page.get_by_text("Kineto trace folder: 8 ranks.")).to_be_visible()
        expect(page.get_by_test_id("stPlotlyChart")).to_have_count(2)
        temporal = page.get_by_test_id("stPlotlyChart").first
        expect(temporal.locator(".barlayer .trace")).to_have_count(3)
        expect(temporal.locator(".xtick text")).to_have_text([f"rank {r}" for r in range(8)])
    if spec.url_path == "planner":
        page.get_by_role("button", name="Plan").click()
        expect(page.get_by_test_id("stPlotlyChart")).to_have_count(1, timeout=240_000)
        wait_drawn(page)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / f"{spec.url_path}.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000  # a drawn page, not a blank or skeleton one


# ------------------------------------------------------------------------------------------------ live


@pytest.mark.multiproc
def test_live_step_count_advances_without_a_reload(server, page, root, child_env, repo_root):
    run_dir = root / "live_job"
    log = root.parent / "live_job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(["timeout", "-k", "10", "600", sys.executable, "-m", "dtprobe.cli", "run",
                                "--nproc", "2", "--steps", "400", "--run-dir", str(run_dir), "--no-devices"],
                               env=child_env(), cwd=repo_root, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        steps_file = run_dir / "events" / "steps" / "rank00000.jsonl"
        deadline = time.monotonic() + 240
        while not (steps_file.exists() and steps_file.read_bytes().count(b"\n") >= 2):
            assert job.poll() is None, f"dtprobe run exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no steps after 240 s:\n{log.read_text()}"
            time.sleep(0.5)
        page.goto(f"{server['url']}/?run=live_job")
        expect(page.get_by_text("live", exact=False).first).to_be_visible()
        value = metric(page, "steps")
        expect(value).to_have_text(re.compile(r"^\d+$"))
        first = int(value.inner_text())
        page.evaluate("window.__not_reloaded = true")
        expect(value).not_to_have_text(str(first))  # auto-waits while the fragment refreshes
        assert int(value.inner_text()) > first
        assert page.evaluate("window.__not_reloaded === true")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "overview_live.png"), full_page=True)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGINT)
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait(10)
