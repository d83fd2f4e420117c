"""``benchmarks/scale_data.py`` writes a tp8 x dp run and a Kineto trace set that dtprobe reads as planted, and
``benchmarks/scale.py`` reports every phase of a tiny size (16 ranks x 5 steps, 2 trace files of 1 MB) in its
``--json``, with the planted straggler named."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import scale_data  # noqa: E402

SCALE_TIMEOUT_S = 240


def test_scale_run_has_100_collectives_per_step_on_tp8_and_dp_groups_when_read_by_the_store(tmp_path):
    from dtprobe.store import RunStore

    spec = scale_data.ScaleRunSpec(world=16, steps=3, straggler_rank=11, delay_ms=80.0)
    run = scale_data.write_run(tmp_path / "run", spec, workers=1, status="finished")
    coll = RunStore.open(run).table("collectives")
    assert len(coll) == 16 * 3 * 100
    per_rank_step = coll.groupby(["rank", "step", "pg"]).size().unstack("pg")
    assert (per_rank_step["tp"] == 60).all() and (per_rank_step["dp"] == 40).all()
    members = coll.loc[coll["rank"] == 11].groupby("pg")["pg_ranks"].unique().to_dict()
    assert list(members["tp"]) == ["8,9,10,11,12,13,14,15"] and list(members["dp"]) == ["3,11"]
    tp_seq = coll.loc[(coll["rank"] == 11) & (coll["pg"] == "tp"), "seq"].sort_values().tolist()
    assert tp_seq == list(range(1, 3 * 60 + 1))
    # every member of a collective completes together; the straggler enqueues 80 ms (+ jitter) after its peers
    ends = coll.groupby(["pg", "pg_ranks", "seq"])["end_ns"].nunique()
    assert (ends == 1).all()
    tp1 = coll.loc[(coll["pg_ranks"] == "8,9,10,11,12,13,14,15") & (coll["seq"] == 1)].set_index("rank")["enqueue_ns"]
    late_ms = (tp1[11] - tp1.drop(11).median()) / 1e6
    assert 77.0 < late_ms < 83.0


def test_trace_set_files_hold_about_the_size_asked_with_their_rank_where_hta_looks_when_written(tmp_path):
    spec = scale_data.TraceSetSpec(ranks=16, mb_per_rank=0.5)
    scale_data.write_trace_set(tmp_path, spec, workers=1)
    files = scale_data.trace_files(tmp_path)
    assert [p.name for p in files] == [f"rank{r:05d}.pt.trace.json" for r in range(16)]
    for rank, path in enumerate(files):
        text = path.read_text()
        assert 0.35e6 < len(text) < 0.65e6
        assert int(re.search(r'"rank":\s+(\d+)', text).group(1)) == rank   # HTA's regex, first match
        doc = json.loads(text)
        groups = {g["pg_desc"]: g["ranks"] for g in doc["distributedInfo"]["pg_config"]}
        assert groups["tp"] == list(range(rank // 8 * 8, rank // 8 * 8 + 8)) and groups["dp"] == [rank % 8,
                                                                                                  rank % 8 + 8]
        kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
        assert {e["args"].get("Process Group Description") for e in kernels} == {None, "tp", "dp"}


@pytest.fixture(scope="module")
def tiny_scale(tmp_path_factory, child_env) -> tuple[dict, Path]:
    """``scale.py`` run once at the tiny size; (its --json document, its workdir)."""
    work = tmp_path_factory.mktemp("scale")
    out = work / "scale.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--ranks", "16", "--steps", "5",
                           "--traces", "2x1", "--hta-mem-gb", "0.005", "--workdir", str(work / "data"), "--json", str(out),
                           "--timeout-s", "120"],
                          env=child_env(), capture_output=True, text=True, timeout=SCALE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "straggler named" in proc.stdout and "yes (rank 11)" in proc.stdout
    assert "HTA ran on 1 of 2 files" in proc.stdout
    assert "layout tp8xdp, no Seq args" in proc.stdout
    return json.loads(out.read_text()), work / "data"


def test_scale_reports_every_run_phase_and_names_the_planted_straggler_when_run_tiny(tiny_scale):
    doc, data = tiny_scale
    [run] = doc["runs"]
    assert (run["ranks"], run["steps"], run["straggler_rank"]) == (16, 5, 11)
    assert run["straggler_named"] is True
    for key in ("write", "open_events", "live_first", "live_refresh", "compact", "open", "analyze", "overview"):
        phase = run["phases"][key]
        assert phase["ok"] is True and phase["seconds"] > 0, (key, phase)
    for key in ("write", "open_events", "compact", "open", "analyze", "overview"):
        assert run["phases"][key]["peak_bytes"] > 20 << 20, key   # an interpreter with numpy at least
    assert run["phases"]["overview"]["stored_summary"] is False        # computed, not read from a summary
    assert run["phases"]["open_events"]["rows"]["collectives"] == 16 * 5 * 100
    # the live phase appended two steps before the run was compacted
    assert run["phases"]["compact"]["rows"]["collectives"] == 16 * 7 * 100
    assert 15_000 < run["events_bytes_per_rank_step"] < 25_000        # 100 rows of about 200 bytes
    assert 0 < run["tables_bytes_per_rank_step"] < run["events_bytes_per_rank_step"]
    assert set(doc["growth"]) >= {"analyze", "overview", "live_refresh"}
    assert not (data / "run16").exists()                               # data removed without --keep


def test_scale_runs_hta_on_the_files_that_fit_and_scales_its_time_when_memory_is_short(tiny_scale):
    doc, _ = tiny_scale
    assert (doc["traces"]["layout"], doc["traces"]["seq"]) == ("tp8xdp", False)    # the defaults
    [size] = doc["traces"]["sizes"]
    assert size["ranks"] == 2 and 1.6e6 < size["raw_bytes"] < 2.4e6
    assert size["dtprobe"]["ok"] is True and size["peak_over_raw"] > 0
    hta = size["hta"]   # 7x 1 MB does not fit in the 5 MB given: HTA reads 1 file, its time counts twice
    assert hta["ok"] is True and (hta["ranks_run"], hta["num_ranks"], hta["scaled"]) == (1, 1, True)
    assert hta["scaled_seconds"] == pytest.approx(2 * hta["seconds"])
    assert size["hta_over_dtprobe"] == pytest.approx(hta["scaled_seconds"] / size["dtprobe"]["seconds"])


def test_scale_growth_exponent_is_the_log_ratio_of_times_over_sizes():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale

    assert scale.growth([64, 256, 1024], [1.0, 4.0, None]) == [pytest.approx(1.0), None]
    assert scale.growth([64, 256], [2.0, 4.0]) == [pytest.approx(0.5)]


def test_scale_goals_judge_the_largest_run_and_the_whole_trace_set():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale

    def run(ranks: int, analyze_s: float, peak: int) -> dict:
        return {"ranks": ranks, "steps": 200, "phases": {
            "analyze": {"ok": True, "seconds": analyze_s, "peak_bytes": peak},
            "overview": {"ok": False, "why": "timeout 3600 s"},
            "live_refresh": {"ok": True, "seconds": 0.15}}}

    def traces(ranks: int, peak: int, raw: int) -> dict:
        return {"ranks": ranks, "raw_bytes": raw, "peak_over_raw": peak / raw,
                "dtprobe": {"ok": True, "seconds": 10.0, "peak_bytes": peak}}

    doc = {"runs": [run(64, 1.0, 1 << 30), run(1024, 8.0, 5_000_000_000)],
           "traces": {"sizes": [traces(16, 400 << 20, 800_000_000),
                                {**traces(64, 480 << 20, 3_200_000_000), "hta": {}, "hta_over_dtprobe": 8.5}]}}
    judged = {g["goal"]: (g["met"], g["value"]) for g in scale.goals(doc)}
    assert judged == {
        "analyze at 1024 ranks x 200 steps <= 10 s": (True, 8.0),
        "analyze peak memory at 1024 ranks x 200 steps <= 4 GB": (False, 5.0),
        "analyze growth exponent 64 -> 1024 ranks <= 1.0": (True, pytest.approx(0.75)),
        # the Overview timed out: not met
        "Overview first computation (finished run) at 1024 ranks x 200 steps <= 3 s": (False, None),
        "live refresh at 1024 ranks x 200 steps <= 200 ms": (True, 0.15),
        "trace set, 16 files: dtprobe peak memory <= 0.5x the raw JSON": (False, pytest.approx(0.524, abs=1e-3)),
        "trace set, 64 files: dtprobe peak memory <= 0.5x the raw JSON": (True, pytest.approx(0.157, abs=1e-3)),
        "trace set: dtprobe peak flat from 16 to 64 files (ratio <= 1.25)": (True, pytest.approx(1.2)),
        "trace set, 64 files: HTA time / dtprobe time >= 9": (False, 8.5),
    }


@pytest.mark.parametrize("flags,layout,seq,pg_descs", [
    ([], "tp8xdp", False, {"tp"}),
    (["--trace-layout", "dp", "--trace-seq"], "dp", True, {"default_pg"}),
    (["--trace-layout", "dp_unnamed"], "dp_unnamed", False, {None}),
])
def test_scale_writes_the_trace_set_in_the_layout_asked_and_names_it_when_given_trace_flags(
        tmp_path, monkeypatch, capsys, flags, layout, seq, pg_descs):
    # the trace set written for real (2 tiny files, in this process); the analysis phases are not run
    import scale

    asked = []

    def run_phase(phase: str, args: dict, **_) -> scale.Outcome:
        asked.append(phase)
        if phase != "write_traces":
            return scale.Outcome(ok=False, why="not run here")
        return scale.Outcome(ok=True, figures=scale.PHASES[phase](args))

    monkeypatch.setattr(scale, "run_phase", run_phase)
    out = tmp_path / "scale.json"
    assert scale.main(["--ranks", "--traces", "2x0.05", "--no-hta", "--keep", "--workdir", str(tmp_path / "data"),
                       "--workers", "1", "--json", str(out), *flags]) == 0
    traces = json.loads(out.read_text())["traces"]
    assert (traces["layout"], traces["seq"]) == (layout, seq)
    assert asked == ["write_traces", "analyze"]
    files = scale_data.trace_files(tmp_path / "data" / "traces2x0.05")
    assert len(files) == 2
    doc = json.loads(files[1].read_text())
    comms = [e["args"] for e in doc["traceEvents"] if e.get("cat") == "kernel" and "Collective name" in e["args"]]
    assert comms and {a.get("Process Group Description") for a in comms} == pg_descs
    assert all(("Seq" in a) == seq for a in comms)
    title = "layout " + layout + (", Seq args" if seq else ", no Seq args")
    assert title in " ".join(capsys.readouterr().out.split())          # the table's title (rich may wrap it)


@pytest.mark.parametrize("flags,message", [
    (["--trace-layout", "tp4xdp"], "argument --trace-layout: invalid choice: 'tp4xdp' (choose from 'dp', "
                                   "'dp_unnamed', 'tp8xdp')"),
    (["--traces", "none", "--trace-seq"], "--traces none skips the foreign trace set, so --trace-seq would have "
                                          "no effect"),
    (["--traces", "none", "--trace-layout", "dp"], "leave out --trace-layout"),
])
def test_scale_rejects_trace_flags_it_cannot_use_when_parsing(capsys, flags, message):
    import scale

    with pytest.raises(SystemExit) as exit_:
        scale.main(["--ranks", *flags])
    assert exit_.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())
