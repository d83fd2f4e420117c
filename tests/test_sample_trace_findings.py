"""Golden findings of every checked-in scenario in ``sample_traces/``: the codes, severities, ranks and groups
``RunAnalysis.open(path).findings()`` gives, plus the figures that say the scenario's fault was read right (the
injected delay, the overflow step, the collective the hang stopped in, the schedule's ideal bubble, ...) and the
world size and number of steps its command made.

Each golden was checked against what its scenario holds (the folder name and its README): a change in the
analysis that changes a verdict here must change the table in the same commit, and say why. A new scenario
folder fails ``test_every_scenario_on_disk_has_a_golden`` until its row is added.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtprobe.analysis import RunAnalysis

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"

Verdict = tuple[str, str, tuple[int, ...], str | None]
"""(code, severity, ranks, group) of one finding."""

GOLDEN: dict[str, list[Verdict]] = {
    # 2 ranks, crash of rank 1 at step 15, torchrun restart from the step-14 checkpoint: the crash is a warning
    # (the job recovered). Saving every 5 steps of a ~20 ms step blocks for ~220 ms each time: a real stall.
    # DDP on gloo overlaps almost nothing: exposed communication.
    "ckpt_crash_restart": [("CHECKPOINT_STALL", "critical", (0, 1), None),
                           ("EXPOSED_COMM", "warning", (0, 1), None),
                           ("RANK_CRASH", "warning", (1,), None)],
    # TP all-reduces of a tiny model are all small: latency-bound, no fault.
    "dp2_tp2": [("COMM_INEFFICIENT", "warning", (), None)],
    # Nothing injected: nothing found.
    "dp4_clean": [],
    # 200 ms sleep on rank 2 each step: rank 2 is the culprit of its dp group, its peers only wait.
    "dp4_straggler_rank2": [("STRAGGLER", "critical", (2,), "dp")],
    # One fp16 overflow at step 10 spread to both ranks by DDP's all-reduce.
    "fp16_overflow": [("AMP_OVERFLOW", "warning", (0, 1), None)],
    # Rank 1 stops issuing collectives at step 5: rank 1 is the hang's culprit; rank 0 only waited.
    "hang_rank1": [("HANG", "critical", (1,), "dp"),
                   ("EXPOSED_COMM", "warning", (0, 1), None)],
    # GPipe, 4 stages, 8 micro-batches, sleep stages: the bubble on every pp rank.
    "pp4_gpipe_bubble": [("PIPELINE_BUBBLE", "warning", (0, 1, 2, 3), "pp")],
    # The uncompressed 4-rank DDP run: gloo overlaps little of its all-reduce.
    "topk_vs_baseline/baseline": [("EXPOSED_COMM", "warning", (0, 1, 2, 3), None)],
    # Top-1% compression read against its baseline: ratio ~50 and a loss gap.
    "topk_vs_baseline/topk": [("COMPRESSION", "warning", (), "dp")],
    # FSDP2 all-gathers and reduce-scatters of a tiny model: some latency-bound, no fault.
    "zero3_dp4": [("COMM_INEFFICIENT", "warning", (), None)],
}
BASELINES = {"topk_vs_baseline/topk": "topk_vs_baseline/baseline"}
"""A scenario analyzed against another (``dtprobe analyze RUN --baseline BASE``), both under ``sample_traces/``."""

FIGURES: dict[tuple[str, str], dict[str, object]] = {
    ("ckpt_crash_restart", "RANK_CRASH"): {"rank": 1, "step": 15, "exit_code": 1, "recovered": True,
                                           "resumed_from_step": 15, "steps_lost": 0, "num_restarts": 1},
    ("ckpt_crash_restart", "CHECKPOINT_STALL"): {"num_saves": 6, "interval_steps": 5.0, "is_async": False},
    ("dp4_straggler_rank2", "STRAGGLER"): {"rank": 2, "victims_mean_wait_ms": pytest.approx(200, rel=0.1)},
    ("fp16_overflow", "AMP_OVERFLOW"): {"num_steps": 14, "num_overflows": 1, "final_scale": 32768.0},
    ("hang_rank1", "HANG"): {"op": "allreduce", "pg": "world", "seq": 11, "step": 5, "cause": "missing_rank"},
    ("pp4_gpipe_bubble", "PIPELINE_BUBBLE"): {"schedule": "gpipe", "num_stages": 4, "num_microbatches": 8,
                                              "ideal_bubble_frac": pytest.approx(3 / 11, abs=0.01)},
    ("topk_vs_baseline/topk", "COMPRESSION"): {"method": "topk:ratio=0.01", "ratio": pytest.approx(50, rel=0.01)},
}
"""Evidence values that hold the scenario's meaning: (scenario, code) -> {evidence key: expected}."""

SHAPES: dict[str, tuple[int, int]] = {
    "ckpt_crash_restart": (2, 30), "dp2_tp2": (4, 8), "dp4_clean": (4, 30), "dp4_straggler_rank2": (4, 30),
    "fp16_overflow": (2, 14), "hang_rank1": (2, 5),      # steps 0-4 completed; the hang stopped step 5
    "pp4_gpipe_bubble": (4, 6), "topk_vs_baseline/baseline": (4, 50), "topk_vs_baseline/topk": (4, 50),
    "zero3_dp4": (4, 8),
}
"""(world size, steps completed) of each scenario, as its ``dtprobe run`` command made it."""


def find_scenarios(root: Path) -> list[str]:
    """Every run under ``root``: a folder holding ``run.json`` is one scenario; a folder without one holds several
    (``topk_vs_baseline/{baseline,topk}``), named ``folder/run``."""
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if (folder / "run.json").is_file():
            found.append(folder.name)
        else:
            found += [f"{folder.name}/{run.name}" for run in sorted(folder.iterdir()) if (run / "run.json").is_file()]
    return found


def verdicts(analysis: RunAnalysis) -> list[Verdict]:
    return [(f.code, f.severity, f.ranks, f.group) for f in analysis.findings()]


def by_severity(rows: list[Verdict]) -> list[Verdict]:
    """Worst first, then by code and ranks: the order of findings with the same severity is not pinned."""
    order = {"critical": 0, "warning": 1, "info": 2}
    return sorted(rows, key=lambda v: (order[v[1]], v[0], v[2]))


def open_scenario(name: str) -> RunAnalysis:
    base = BASELINES.get(name)
    return RunAnalysis.open(SAMPLES / name, baseline=SAMPLES / base if base else None)


SCENARIOS = find_scenarios(SAMPLES)


def test_every_scenario_on_disk_has_a_golden():
    assert set(SCENARIOS) - set(GOLDEN) == set(), "add the new scenario's findings to GOLDEN"
    assert set(GOLDEN) - set(SCENARIOS) == set(), "a golden names a scenario that is no longer on disk"
    assert set(SHAPES) == set(GOLDEN)


def test_a_new_scenario_folder_is_found_including_a_run_nested_one_level(tmp_path):
    (tmp_path / "new_case").mkdir()
    (tmp_path / "new_case" / "run.json").write_text("{}")
    (tmp_path / "pair" / "a").mkdir(parents=True)
    (tmp_path / "pair" / "a" / "run.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    assert find_scenarios(tmp_path) == ["new_case", "pair/a"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_findings_match_their_golden(name):
    assert name in GOLDEN, f"{name}: no golden; add its findings to GOLDEN after checking them against the scenario"
    got = verdicts(open_scenario(name))
    assert by_severity(got) == got, "findings are not worst first"
    assert by_severity(got) == by_severity(GOLDEN[name])


@pytest.mark.parametrize("name,code", sorted(FIGURES), ids=lambda v: v if isinstance(v, str) else None)
def test_scenario_evidence_holds_the_figures_of_its_fault(name, code):
    [finding] = [f for f in open_scenario(name).findings() if f.code == code]
    evidence = finding.to_json()["evidence"]
    expected = FIGURES[(name, code)]
    assert {k: evidence.get(k) for k in expected} == expected


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_world_size_and_steps_are_those_of_its_command(name):
    analysis = open_scenario(name)
    assert (analysis.world_size, analysis.key_figures().num_steps) == SHAPES[name]


def test_analyze_json_of_the_straggler_scenario_gives_its_golden_and_exit_1(sample_trace_analyze):
    name = "dp4_straggler_rank2"
    proc = sample_trace_analyze(name)
    assert proc.returncode == 1, proc.stderr[-3000:]              # 1: a critical finding
    doc = json.loads(proc.stdout)
    got = [(f["code"], f["severity"], tuple(f["ranks"]), f["group"]) for f in doc["findings"]]
    assert got == GOLDEN[name]
