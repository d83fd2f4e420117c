"""`dtprobe serve-metrics ROOT`: scraped over HTTP on 127.0.0.1 and parsed with ``prometheus_client.parser``; the
gauges of finished sample runs equal `dtprobe analyze --format json` and the store; the gauges of a `dtprobe run`
scraped while it runs move and match the store; SIGTERM and Ctrl-C stop the server cleanly."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from background_run import background_run, wait_for
from prometheus_client.parser import text_string_to_metric_families

from dtprobe.store import RunStore

LABELS = {
    "dtprobe_step_time_seconds": {"run", "rank"},
    "dtprobe_tokens_per_second": {"run"},
    "dtprobe_lateness_ratio": {"run", "rank", "pg"},
    "dtprobe_exposed_comm_ratio": {"run", "rank"},
    "dtprobe_findings": {"run", "code", "severity"},
    "dtprobe_last_step": {"run", "rank"},
}
"""The gauges issue 16 names, with their labels exactly."""
SERVE = "import sys; from dtprobe.cli import main; sys.exit(main(sys.argv[1:]))"


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample at http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        assert response.status == 200
        text = response.read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def of(samples, name: str, **labels: str) -> dict[tuple, float]:
    """The values of gauge ``name`` whose labels include ``labels``, keyed by their other labels' values (sorted by
    label name)."""
    out = {}
    for n, lab, value in samples:
        if n == name and all(lab.get(k) == v for k, v in labels.items()):
            out[tuple(v for k, v in sorted(lab.items()) if k not in labels)] = value
    return out


def start_server(start_python, root: Path, port: int, *extra: str):
    proc = start_python(SERVE, "serve-metrics", root, "--port", str(port), *extra, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            scrape(port)
            return proc
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                pytest.fail(f"serve-metrics ended ({proc.returncode}): {proc.stderr.read()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("serve-metrics did not answer within 120 s")
            time.sleep(0.2)


def stop_server(proc, sig: int) -> str:
    """Send ``sig``; the server must exit 0 with its closing line and no traceback. Returns its stderr."""
    proc.send_signal(sig)
    err = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0, err
    assert "dtprobe serve-metrics: stopped" in err and "Traceback" not in err
    return err


def test_serve_metrics_of_finished_runs_equal_analyze_json_and_the_store(tmp_path, sample_traces_dir,
                                                                        sample_trace_analyze, start_python,
                                                                        free_port):
    root = tmp_path / "runs"
    for scenario in ("fp16_overflow", "dp4_straggler_rank2"):
        shutil.copytree(sample_traces_dir / scenario, root / scenario)
    port = free_port()
    proc = start_server(start_python, root, port, "--all")
    samples = scrape(port)
    assert {name for name, _, _ in samples} == set(LABELS)
    for name, labels, _ in samples:
        assert set(labels) == LABELS[name], name
    for scenario in ("fp16_overflow", "dp4_straggler_rank2"):
        doc = json.loads(sample_trace_analyze(scenario).stdout)    # root holds copies of these sample runs
        m = doc["metrics"]
        assert of(samples, "dtprobe_tokens_per_second", run=scenario)[()] == pytest.approx(
            m["throughput"]["tokens_per_s"], abs=1e-6)
        exposed = of(samples, "dtprobe_exposed_comm_ratio", run=scenario)
        assert exposed == {(str(r["rank"]),): pytest.approx(r["exposed_frac"], abs=1e-6) for r in m["comm_exposure"]}
        for worst in m["latest_rank_by_group"]:
            lateness = of(samples, "dtprobe_lateness_ratio", run=scenario, pg=worst["pg"])
            assert lateness[(str(worst["rank"]),)] == pytest.approx(worst["median_lateness_frac"], abs=1e-6)
            assert max(lateness, key=lateness.get) == (str(worst["rank"]),)
        findings = Counter((f["code"], f["severity"]) for f in doc["findings"])
        assert of(samples, "dtprobe_findings", run=scenario) == {k: float(n) for k, n in findings.items()}
        steps = RunStore.open(root / scenario).table("steps")
        last = steps.sort_values("end_ns").groupby("rank").tail(1)
        assert of(samples, "dtprobe_last_step", run=scenario) == {(str(r.rank),): float(r.step) for r in last.itertuples()}
        assert of(samples, "dtprobe_step_time_seconds", run=scenario) == {
            (str(r.rank),): pytest.approx((r.end_ns - r.start_ns) / 1e9, abs=1e-9) for r in last.itertuples()}
    assert of(samples, "dtprobe_findings", run="dp4_straggler_rank2") == {("STRAGGLER", "critical"): 1.0}
    stop_server(proc, signal.SIGTERM)


def test_serve_metrics_leaves_finished_runs_out_without_all(tmp_path, sample_traces_dir, start_python, free_port):
    shutil.copytree(sample_traces_dir / "fp16_overflow", tmp_path / "runs" / "fp16_overflow")
    port = free_port()
    proc = start_server(start_python, tmp_path / "runs", port)
    assert scrape(port) == []
    stop_server(proc, signal.SIGINT)


def test_serve_metrics_refuses_a_root_that_is_not_a_directory(tmp_path, run_cli, free_port):
    res = run_cli("serve-metrics", tmp_path / "nowhere", "--port", str(free_port()))
    assert res.returncode == 2
    assert "is not a directory" in res.stderr and "Traceback" not in res.stderr


def test_serve_metrics_on_a_port_in_use_exits_2_naming_the_address(tmp_path, run_cli):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_cli("serve-metrics", tmp_path, "--port", str(port))
    assert res.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in res.stderr and "--port" in res.stderr
    assert "Traceback" not in res.stderr


def _checked_against_store(samples, run_dir: Path, run: str) -> dict[int, int]:
    """Each rank's exported newest step and its duration are a row of the store (read after the scrape); returns
    rank -> last step."""
    steps = RunStore.open(run_dir).table("steps").set_index(["rank", "step"])
    last = {int(k[0]): int(v) for k, v in of(samples, "dtprobe_last_step", run=run).items()}
    assert set(last) == {0, 1}
    for (rank,), seconds in of(samples, "dtprobe_step_time_seconds", run=run).items():
        row = steps.loc[(int(rank), last[int(rank)])]
        assert seconds == pytest.approx((row["end_ns"] - row["start_ns"]) / 1e9, abs=1e-9)
    return last


@pytest.mark.multiproc
@pytest.mark.exclusive
def test_serve_metrics_scraped_while_a_run_runs_moves_and_matches_the_store(tmp_path, child_env, start_python,
                                                                           free_port):
    root = tmp_path / "runs"
    root.mkdir()
    run_dir = root / "live"
    port = free_port()
    server = start_server(start_python, root, port)
    assert scrape(port) == []                                  # no run yet
    cmd = [sys.executable, "-m", "dtprobe.cli", "run", "--run-dir", str(run_dir), "--no-devices", "--timeout", "60",
           "--batch-size", "2", "--seq-len", "16", "--nproc", "2", "--steps", "400"]
    with background_run(cmd, env=child_env()) as proc:
        def last_steps() -> dict[tuple, float]:
            return of(scrape(port), "dtprobe_last_step", run="live")

        wait_for(lambda: len(last_steps()) == 2 and min(last_steps().values()) >= 3, timeout=240, proc=proc,
                 what="both ranks' step 3 in a scrape", poll_s=0.2)
        first = scrape(port)
        first_last = _checked_against_store(first, run_dir, "live")
        wait_for(lambda: len(last_steps()) == 2 and min(last_steps().values()) >= max(first_last.values()) + 3,
                 timeout=240, proc=proc, what="three more steps in a scrape", poll_s=0.2)
        second = scrape(port)
        second_last = _checked_against_store(second, run_dir, "live")
        assert all(second_last[r] > first_last[r] for r in (0, 1))      # the values move between scrapes
        for samples in (first, second):
            (tokens,) = of(samples, "dtprobe_tokens_per_second", run="live").values()
            assert tokens > 0 and math.isfinite(tokens)
            assert set(of(samples, "dtprobe_exposed_comm_ratio", run="live")) == {("0",), ("1",)}
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    assert RunStore.open(run_dir).manifest.status == "finished"
    assert of(scrape(port), "dtprobe_last_step", run="live") == {}     # finished: no longer a running run
    err = stop_server(server, signal.SIGINT)
    assert "live: exported (running, world size 2)" in err and "live: finished, no longer exported" in err


def test_collector_analyses_a_running_runs_newest_steps_and_reuses_them_while_nothing_changes(tmp_path,
                                                                                              sample_traces_dir):
    from dtprobe.analysis.facade import RunAnalysis
    from dtprobe.analysis.window import StepWindow
    from dtprobe.export.prometheus import RunsCollector
    from dtprobe.store.manifest import set_status

    run_dir = tmp_path / "runs" / "dp4_straggler_rank2"
    shutil.copytree(sample_traces_dir / "dp4_straggler_rank2", run_dir)
    set_status(run_dir, "running")                            # a run still going, as far as the exporter knows
    events = []
    collector = RunsCollector(tmp_path / "runs", window_steps=8, on_event=events.append)
    (sample,) = collector.samples()
    window = RunAnalysis(StepWindow(RunStore.open(run_dir), 8))
    whole = RunAnalysis(RunStore.open(run_dir))
    assert window.steps_analyzed() == list(range(23, 30))      # steps 22..29, the first skipped as warm-up
    assert sample.tokens_per_s == window.key_figures().tokens_per_s != whole.key_figures().tokens_per_s
    assert sample.exposed_comm == dict(zip(window.exposure_by_rank()["rank"], window.exposure_by_rank()["exposed_frac"]))
    assert sample.last_step == {0: 29, 1: 29, 2: 29, 3: 29}
    assert collector.samples()[0] is sample                   # nothing appended: not analysed again
    set_status(run_dir, "finished")
    assert collector.samples() == []
    assert events == ["dp4_straggler_rank2: exported (running, world size 4)",
                      "dp4_straggler_rank2: finished, no longer exported"]


def test_collector_serves_root_itself_when_root_is_a_run_and_names_an_unreadable_run_once(tmp_path,
                                                                                          sample_traces_dir):
    from dtprobe.export.prometheus import RunsCollector

    run_dir = tmp_path / "fp16_overflow"
    shutil.copytree(sample_traces_dir / "fp16_overflow", run_dir)
    (sample,) = RunsCollector(run_dir, include_finished=True).samples()
    assert sample.run == "fp16_overflow" and sample.last_step == {0: 13, 1: 13}

    root = tmp_path / "runs"
    shutil.copytree(sample_traces_dir / "fp16_overflow", root / "good")
    (root / "broken").mkdir()
    (root / "broken" / "run.json").write_text("{not json")
    events = []
    collector = RunsCollector(root, include_finished=True, on_event=events.append)
    assert [s.run for s in collector.samples()] == [s.run for s in collector.samples()] == ["good"]
    broken = [e for e in events if e.startswith("broken:")]
    assert len(broken) == 1 and "left out, cannot be read" in broken[0] and "run.json" in broken[0]
