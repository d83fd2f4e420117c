"""Dashboard (Streamlit AppTest): the clocks behind timing verdicts are shown where a user reads them. The
Overview says how the ranks' clocks were aligned and which clock arrivals were read on (``metrics.run``), each
finding card names its evidence clock, and the Stragglers page names the clock of its lateness in its caption,
chart titles, axes and columns. On a CPU (host-clock) run, on the same CUDA run recorded on the device clock and
host-only (``dtprobe.synthetic.cuda_dp_tables``), and on the DLRM trace folder whole (clocks aligned from the
collectives) and cut to 2 of its 8 ranks (not aligned)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from test_dashboard import DLRM, _fresh_streamlit, app, figures, page_text, user_cache  # noqa: F401 (fixtures)

from dtprobe import overview as ov
from dtprobe import summary_store
from dtprobe.analysis.facade import RunAnalysis
from dtprobe.dashboard import clocks, data
from dtprobe.dashboard.paths import resolve_choice
from dtprobe.synthetic import cuda_dp_tables, write_run, write_synthetic_run

STRAGGLER = 2
HOST_ALIGNED = "Ranks' clocks aligned by the host clock offsets dtprobe measured (`host`)."
HOST_ARRIVALS = ("Arrivals read on the host clock (`host`: host enqueue times; on CUDA that is the kernel launch, "
                 "not its execution).")
DEVICE_ARRIVALS = "Arrivals read on the device clock (`device`: when each rank's device reached the collective)."


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """cpu: a CPU/gloo-style run with a straggler (host clock only); cuda_device / cuda_host: one CUDA DDP run
    whose rank 2 has a slow device, as the CUDA collectors write it and as a host-only recorder sees it."""
    root = tmp_path_factory.mktemp("clock_runs")
    write_synthetic_run(root / "cpu", num_ranks=4, num_steps=40, straggler_rank=STRAGGLER)
    for clock in ("device", "host"):
        write_run(root / f"cuda_{clock}", cuda_dp_tables(clock=clock, straggler=STRAGGLER, delay_ms=15.0),
                  world_size=4, config={"layout": {"dp": 4, "tp": 1, "pp": 1}})
    return root


@pytest.fixture(scope="module")
def partial_traces(tmp_path_factory) -> Path:
    """Two of the DLRM folder's eight ranks: the group is not whole, so the clocks cannot be aligned."""
    folder = tmp_path_factory.mktemp("dlrm_2_of_8")
    for trace in sorted(DLRM.iterdir())[:2]:
        shutil.copy(trace, folder / trace.name)
    return folder


def captions(at) -> list[str]:
    return [c.value for c in at.caption]


def evidence_lines(at) -> list[str]:
    return [c for c in captions(at) if c.startswith("Timing evidence on the")]


def column_labels(at) -> dict[str, str]:
    """Column -> label of every shown dataframe's column configuration (labels set by the page)."""
    labels = {}
    for frame in at.dataframe:
        config = json.loads(frame.proto.columns or "{}")
        labels.update({col: cfg["label"] for col, cfg in config.items() if "label" in cfg})
    return labels


def expected_evidence(path: Path) -> list[str]:
    """The evidence lines the cards must show: one per finding whose evidence names a clock (analyze's JSON)."""
    report = RunAnalysis.open(path).report()
    return sorted(f"Timing evidence on the {clocks.CLOCK_WORDS[f['evidence']['clock']]} (`{f['evidence']['clock']}`)."
                  for f in report["findings"] if f["evidence"].get("clock"))


# ------------------------------------------------------------------------------------------------ Overview


@pytest.mark.parametrize("run,aligned,arrivals,straggler_clock", [
    ("cpu", HOST_ALIGNED, HOST_ARRIVALS, "host"),
    ("cuda_device", HOST_ALIGNED, DEVICE_ARRIVALS, "device"),
    ("cuda_host", HOST_ALIGNED, HOST_ARRIVALS, None),        # the slow device is no straggler on host times
])
def test_overview_header_names_the_alignment_and_arrival_clock_and_cards_their_evidence_clock(
        runs, monkeypatch, run, aligned, arrivals, straggler_clock):
    report = RunAnalysis.open(runs / run).report()
    assert report["metrics"]["run"]["clock_aligned"] == "host"
    at = app(runs, monkeypatch, run=run)
    assert not at.exception, [e.message for e in at.exception]
    assert f"{aligned}  \n{arrivals}" in captions(at)
    assert sorted(evidence_lines(at)) == expected_evidence(runs / run)
    codes = [f["code"] for f in report["findings"]]
    if straggler_clock is None:
        assert "STRAGGLER" not in codes and "Timing evidence on the host clock (`host`)." in evidence_lines(at)
    else:
        assert codes.count("STRAGGLER") == 1
        assert f"Timing evidence on the {straggler_clock} clock (`{straggler_clock}`)." in evidence_lines(at)


def test_overview_of_a_trace_folder_says_its_clocks_were_aligned_from_the_collectives(monkeypatch):
    at = app(DLRM, monkeypatch)
    assert not at.exception
    assert ("Ranks' clocks aligned from the collectives' ends on the device (`device_collectives`): a trace folder "
            f"records no offsets.  \n{DEVICE_ARRIVALS}") in captions(at)
    assert evidence_lines(at) == expected_evidence(DLRM) == ["Timing evidence on the device clock (`device`)."]


def test_overview_of_a_partial_trace_folder_says_why_its_clocks_are_not_aligned(partial_traces, monkeypatch):
    why = RunAnalysis.open(partial_traces).clock_alignment()
    assert why.startswith("not aligned: only 2 of the group's 8 members")
    at = app(partial_traces, monkeypatch)
    assert not at.exception
    assert (f"Ranks' clocks not aligned: {why.removeprefix('not aligned: ')}.  \nArrivals timed on the device clock "
            "(`device`: when each rank's device reached the collective) were not compared across ranks: their "
            "clocks are not aligned.") in captions(at)


def test_overview_drawn_from_a_stored_summary_shows_the_stored_clocks(tmp_path, monkeypatch):
    run = write_synthetic_run(tmp_path / "stored", num_ranks=2, num_steps=6)
    made = ov.summarize(RunAnalysis.open(run), path=str(run.resolve()))
    stored = dataclasses.replace(made, clock_aligned="not aligned: from the stored summary", arrival_clock="mixed")
    summary_store.store(run, stored, key=summary_store.key_of(run), in_run_dir=True)
    at = app(tmp_path, monkeypatch)
    assert not at.exception and data.open_store(resolve_choice(tmp_path, "stored")) is None   # never analyzed
    assert ("Ranks' clocks not aligned: from the stored summary.  \nArrivals timed on the mixed host and device "
            "clocks (`mixed`: device arrivals in the groups that have them, host enqueues elsewhere) were not "
            "compared across ranks: their clocks are not aligned.") in captions(at)


def test_a_stored_summary_without_clocks_is_made_again_with_them(tmp_path):
    run = write_synthetic_run(tmp_path / "old", num_ranks=4, num_steps=12, straggler_rank=STRAGGLER)
    key = summary_store.key_of(run)
    summary_store.store(run, ov.summarize(RunAnalysis.open(run), path=str(run.resolve())), key=key, in_run_dir=True)
    file = run.resolve() / summary_store.SUMMARY_FILE
    doc = json.loads(file.read_text())
    assert doc["overview"]["clock_aligned"] == "host" and doc["overview"]["arrival_clock"] == "host"
    assert {f["code"]: f["clock"] for f in doc["overview"]["findings"]}["STRAGGLER"] == "host"
    for key_name in ("clock_aligned", "arrival_clock"):            # a summary written before the clocks were kept
        del doc["overview"][key_name]
    for finding in doc["overview"]["findings"]:
        del finding["clock"]
    file.write_text(json.dumps(doc))
    assert summary_store.load(run) is None
    shown = data.load_overview(resolve_choice(tmp_path, "old"))
    assert shown.clock_aligned == "host" and shown.arrival_clock == "host"


# ------------------------------------------------------------------------------------------------ Stragglers


@pytest.mark.parametrize("run,clock", [("cpu", "host"), ("cuda_device", "device"), ("cuda_host", "host")])
def test_stragglers_page_labels_lateness_with_the_clock_it_was_read_on(runs, monkeypatch, run, clock):
    at = app(runs, monkeypatch, run=run)
    at.switch_page("views/stragglers.py").run()
    assert not at.exception, [e.message for e in at.exception]
    words = f"{clock} clock"
    other = "host clock" if clock == "device" else "device clock"
    arrivals = DEVICE_ARRIVALS if clock == "device" else HOST_ARRIVALS
    assert f"{HOST_ALIGNED}  \n{arrivals}" in captions(at)
    figs = figures(at)
    heat = figs["stragglers_heatmap"]
    assert heat["layout"]["title"]["text"] == (f"Arrival lateness on the {words} (rank × step): red = arrives "
                                               "after its peers")
    assert heat["data"][0]["colorbar"]["title"]["text"] == f"late / step<br>({words})"
    assert heat["data"][0]["hovertemplate"].endswith(f"of the step late ({words})<extra></extra>")
    assert figs["stragglers_victims"]["layout"]["yaxis"]["title"]["text"] == (f"mean wait for the latest arrival per "
                                                                             f"step (ms, {words})")
    assert column_labels(at)["median_lateness_frac"] == f"median lateness ({words})"
    assert other not in json.dumps(heat) and other not in json.dumps(figs["stragglers_victims"])
    straggler_cards = [f for f in RunAnalysis.open(runs / run).findings() if f.code == "STRAGGLER"]
    assert evidence_lines(at) == [f"Timing evidence on the {f.evidence['clock']} clock (`{f.evidence['clock']}`)."
                                  for f in straggler_cards]
    assert [f.evidence["clock"] for f in straggler_cards] == ([] if run == "cuda_host" else [clock])


def test_stragglers_page_of_a_trace_folder_plots_device_clock_arrivals(monkeypatch):
    arrivals = RunAnalysis.open(DLRM).arrival_summary()
    at = app(DLRM, monkeypatch)
    at.switch_page("views/stragglers.py").run()
    assert not at.exception
    assert captions(at)[0] == clocks.run_clocks("device_collectives", "device")
    assert captions(at)[0].endswith(f"  \n{DEVICE_ARRIVALS}")
    fig = figures(at)["stragglers_device_arrivals"]
    assert fig["layout"]["yaxis"]["title"]["text"] == "median lateness (µs, device clock)"
    assert fig["layout"]["title"]["text"] == "Arrival lateness on the device clock: above 0 = after its peers' median"
    labels = column_labels(at)
    assert labels["median_lateness_us"] == "median lateness (µs, device clock)"
    assert labels["caused_wait_us"] == "peers' wait it caused, total (µs, device clock)"
    shown = next(d.value for d in at.dataframe if "median_lateness_us" in d.value.columns).set_index("rank")
    assert shown.loc[7, "median_lateness_us"] == pytest.approx(129.0)      # the DLRM job's latest rank
    assert shown["median_lateness_us"].to_dict() == pytest.approx(arrivals.set_index("rank")["median_lateness_us"]
                                                                  .to_dict())


def test_stragglers_page_of_a_partial_trace_folder_says_why_there_is_no_lateness(partial_traces, monkeypatch):
    at = app(partial_traces, monkeypatch)
    at.switch_page("views/stragglers.py").run()
    assert not at.exception
    assert "stragglers_device_arrivals" not in figures(at)
    assert any(i.value.startswith("No arrival lateness for this trace folder: its ranks' clocks could not be "
                                  "aligned") for i in at.info)


# ------------------------------------------------------------------------------------------------ the words


@pytest.mark.parametrize("clock_aligned,line", [
    ("host", HOST_ALIGNED),
    ("device_collectives", "Ranks' clocks aligned from the collectives' ends on the device (`device_collectives`): "
                           "a trace folder records no offsets."),
    ("not aligned: no NCCL kernels", "Ranks' clocks not aligned: no NCCL kernels."),
    ("not aligned: add the others' traces.", "Ranks' clocks not aligned: add the others' traces."),
])
def test_alignment_line_names_each_alignment(clock_aligned, line):
    assert clocks.alignment_line(clock_aligned) == line


@pytest.mark.parametrize("clock,line", [
    (None, None), ("host", "Timing evidence on the host clock (`host`)."),
    ("device", "Timing evidence on the device clock (`device`)."),
    ("mixed", "Timing evidence on the mixed host and device clocks (`mixed`)."),
])
def test_evidence_line_names_the_clock_or_nothing_for_a_finding_without_timing(clock, line):
    assert clocks.evidence_line(clock) == line


def test_arrival_line_says_when_there_are_no_collectives():
    assert clocks.arrival_line(None, "host") == "No collective arrivals: no straggler verdict."
