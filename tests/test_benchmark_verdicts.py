"""``benchmarks/verdicts.py`` scores a slowdown run by the slowdown it realized as well as by its nominal one:
the faulted rank's own compute (fwd + opt from the raw step rows; a pipeline rank's summed action lengths) against
the other ranks', after the fault over before it; and by the job's step-time change (the job effect)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import verdicts  # noqa: E402


def _write_steps(run: Path, fwd_opt_ms: dict[int, list[float]]) -> None:
    """Step rows per rank whose fwd + opt is the given ms per step (fwd 3/4 of it, opt 1/4)."""
    folder = run / "events" / "steps"
    folder.mkdir(parents=True)
    for rank, per_step in fwd_opt_ms.items():
        lines = [json.dumps({"rank": rank, "step": step, "restart": 0, "fwd_ns": int(ms * 0.75e6),
                             "opt_ns": int(ms * 0.25e6), "bwd_ns": 5_000_000})
                 for step, ms in enumerate(per_step)]
        (folder / f"rank{rank:05d}.jsonl").write_text("\n".join(lines) + "\n" + '{"rank": ')   # a torn last line


def test_realized_slowdown_is_the_faulted_ranks_compute_against_its_peers_after_over_before(tmp_path):
    # 20 steps, fault from step 10; everyone 20% slower after it (the host), rank 1 a further 15% on top
    base = {0: 100.0, 1: 110.0, 2: 90.0}
    rows = {r: [500.0] * 3 + [ms] * 7 + [ms * 5] + [ms * 1.2 * (1.15 if r == 1 else 1.0)] * 9
            for r, ms in base.items()}
    _write_steps(tmp_path, rows)
    assert verdicts.realized_slowdown(tmp_path, 1, 10) == pytest.approx(0.15)
    assert verdicts.realized_slowdown(tmp_path, 0, 10) == pytest.approx(120 / ((110 * 1.2 * 1.15 + 90 * 1.2) / 2) - 1)
    assert verdicts.realized_slowdown(tmp_path, 3, 10) is None          # no rows of that rank


def test_a_pipeline_ranks_realized_slowdown_is_of_its_actions_not_of_fwd_that_holds_its_waits(tmp_path):
    # 2 stages; rank 1's actions 10% longer from step 10, while its fwd (waits for stage 0 included) barely moves
    _write_steps(tmp_path, {0: [100.0] * 20, 1: [100.0] * 10 + [101.0] * 10})
    folder = tmp_path / "events" / "pipeline"
    folder.mkdir()
    for rank in (0, 1):
        rows, t = [], 0
        for step in range(20):
            for microbatch in range(2):
                for action in ("F", "B"):
                    ms = 20.0 * (1.1 if rank == 1 and step >= 10 else 1.0)
                    rows.append({"rank": rank, "stage": rank, "step": step, "microbatch": microbatch,
                                 "action": action, "start_ns": t, "end_ns": t + int(ms * 1e6)})
                    t += int(50e6)
        (folder / f"rank{rank:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert verdicts.realized_slowdown(tmp_path, 1, 10) == pytest.approx(0.10)


def test_report_scores_the_runs_that_realized_ten_percent_apart_from_the_nominal_class():
    def run(slowdown: float, realized: float | None, tp: bool) -> verdicts.Outcome:
        sc = verdicts.Scenario(kind="quota", layout="dp2", rank=1, slowdown=slowdown, fault_step=10)
        return verdicts.Outcome(scenario=sc, true_positive=tp, realized=realized, detect_steps=5 if tp else None)

    outcomes = [run(0.1, 0.04, False), run(0.1, 0.12, True), run(0.2, 0.30, True), run(0.05, 0.11, True),
                verdicts.Outcome(scenario=verdicts.Scenario(kind="clean", layout="dp2"))]
    rows = {line.split()[0]: line.split() for line in verdicts.report(outcomes).splitlines()[1:]}
    # columns: class runs TP FN FP FPconf other err precision recall ttd-med ttd-max real-med% job-range
    # job-med% gain-med%
    assert rows["slow>=10%"][1:4] == ["3", "2", "1"] and rows["slow>=10%"][9] == "0.67"
    assert rows["real>=10%"][1:4] == ["3", "3", "0"] and rows["real>=10%"][9] == "1.00"
    assert rows["real>=10%"][12] == "+12"                                 # median of 12, 30 and 11%
    assert rows["quota-10"][12] == "+8"                                   # median of 4 and 12%
    assert rows["clean"][12] == "-"


def _write_step_spans(run: Path, step_ms: dict[int, list[float]], *, restart_of: dict | None = None) -> None:
    """Step rows per rank (start_ns, end_ns) lasting the given ms; ``restart_of``: (rank, step) -> rows of that
    step written again by a later attempt, lasting the given ms."""
    folder = run / "events" / "steps"
    folder.mkdir(parents=True)
    for rank, per_step in step_ms.items():
        rows = [{"rank": rank, "step": step, "restart": 0, "start_ns": step * 10**9,
                 "end_ns": step * 10**9 + int(ms * 1e6)} for step, ms in enumerate(per_step)]
        rows += [{"rank": r, "step": st, "restart": 1, "start_ns": 99 * 10**9, "end_ns": 99 * 10**9 + int(ms * 1e6)}
                 for (r, st), ms in (restart_of or {}).items() if r == rank]
        (folder / f"rank{rank:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_job_effect_is_the_median_step_time_after_the_fault_over_before_from_the_raw_rows(tmp_path):
    # rank 2 slowed 50% from step 10 but its peers' step rows (which wait for it) only 12%: the job is the ranks'
    # median; step 12 was redone after a restart, the last attempt's rows count
    rows = {r: [900.0] * 3 + [100.0] * 7 + [400.0] + [112.0 if r != 2 else 150.0] * 9 for r in (0, 1, 2)}
    _write_step_spans(tmp_path, rows, restart_of={(0, 12): 112.0, (1, 12): 112.0, (2, 12): 150.0})
    assert verdicts.job_effect(tmp_path, 10) == pytest.approx(0.12)
    assert verdicts.job_effect(tmp_path, 30) is None                  # no steps after it
    # only a first attempt's slow rows at step 12, redone fast: the redone rows are the step's
    slow = tmp_path / "slow"
    _write_step_spans(slow, {r: [100.0] * 12 + [900.0] + [100.0] * 7 for r in (0, 1)},
                      restart_of={(0, 12): 100.0, (1, 12): 100.0})
    assert verdicts.job_effect(slow, 10) == pytest.approx(0.0)


def test_report_prints_the_range_of_each_classs_job_effects():
    def run(job: float | None, tp: bool) -> verdicts.Outcome:
        sc = verdicts.Scenario(kind="inject", layout="dp2xpp2", rank=1, slowdown=0.1, fault_step=10)
        return verdicts.Outcome(scenario=sc, true_positive=tp, job=job)

    clean = [verdicts.Outcome(scenario=verdicts.Scenario(kind="clean", layout="dp2"), job=j) for j in (-0.02, 0.07)]
    outcomes = [run(0.01, False), run(0.08, True), run(-0.05, True), run(None, False), *clean]
    rows = {line.split()[0]: line.split() for line in verdicts.report(outcomes).splitlines()[1:]}
    assert rows["inject-10"][1:4] == ["4", "2", "2"] and rows["inject-10"][13] == "-5..+8"
    assert rows["clean"][13] == "-2..+7"
    assert rows["overall"][13] == "-5..+8"
    assert rows["slow>=10%"][13] == "-5..+8"


def test_the_true_positives_predicted_gain_is_kept_and_its_class_median_printed_beside_the_job_effects(tmp_path):
    sc = verdicts.Scenario(kind="inject", layout="dp2", rank=1, slowdown=0.2, fault_step=10)
    finding = {"code": "STRAGGLER", "severity": "warning", "ranks": [1], "evidence": {"cause": "compute"},
               "predicted_gain": {"metric": "step_time", "frac": 0.083}}
    other = {**finding, "ranks": [0], "predicted_gain": {"metric": "step_time", "frac": 0.5}}
    scored = verdicts.score(sc, {"findings": [other, finding]}, tmp_path, nominal_fault_step=10)
    assert scored.true_positive and scored.gain == 0.083                  # the true positive's, not the other's
    assert verdicts.score(sc, {"findings": [{**finding, "predicted_gain": None}]}, tmp_path,
                          nominal_fault_step=10).gain is None

    def run(job: float, gain: float | None) -> verdicts.Outcome:
        return verdicts.Outcome(scenario=sc, true_positive=gain is not None, job=job, gain=gain)

    outcomes = [run(0.02, 0.01), run(0.30, 0.12), run(0.10, 0.04), run(0.50, None)]
    rows = {line.split()[0]: line.split() for line in verdicts.report(outcomes).splitlines()[1:]}
    # columns: ... real-med% job-range job-med% gain-med%
    assert rows["inject-20"][13:] == ["+2..+50", "+20.0", "4.0"]    # gains of the true positives only
    assert rows["overall"][14:] == ["+20.0", "4.0"]
    assert "predicted gain 8.3%" in verdicts._realized_text(scored)


def test_a_rank_stall_is_the_pause_scenarios_verdict_and_a_false_positive_anywhere_else(tmp_path):
    stall = {"code": "RANK_STALL", "severity": "critical", "ranks": [2], "evidence": {}}
    pause = verdicts.Scenario(kind="pause", layout="dp4", rank=2, fault_step=10)
    assert verdicts.score(pause, {"findings": [stall]}, tmp_path, nominal_fault_step=10).true_positive
    clean = verdicts.score(verdicts.Scenario(kind="clean", layout="dp4"), {"findings": [stall]}, tmp_path,
                           nominal_fault_step=10)
    assert clean.false_positives == ["RANK_STALL(critical) rank 2"]
    info = {**stall, "severity": "info"}                  # a stall that cost under 1% of the run: no verdict
    assert not verdicts.score(pause, {"findings": [info]}, tmp_path, nominal_fault_step=10).true_positive


def test_the_pause_scenarios_are_drawn_after_the_others_so_their_ranks_stay_as_they_were():
    def matrix(kinds):
        args = type("Args", (), {"seed": 0, "layouts": ["dp2", "dp4"], "repeats": 1, "slowdowns": [0.1],
                                 "kinds": kinds})()
        return [(sc.kind, sc.layout, sc.rank) for sc in verdicts.build_matrix(args)]

    with_pause = matrix(list(verdicts.KINDS))
    assert [s for s in with_pause if s[0] != "pause"] == matrix([k for k in verdicts.KINDS if k != "pause"])
    assert [s[:2] for s in with_pause if s[0] == "pause"] == [("pause", "dp2"), ("pause", "dp4")]


def _checkout(root: Path) -> None:
    """A checkout's source folders, one Python file in each."""
    for folder in verdicts.SOURCE_DIRS:
        (root / folder).mkdir(parents=True)
        (root / folder / "module.py").write_text("X = 1\n")


def test_source_fingerprint_changes_when_a_source_file_is_edited_added_or_removed(tmp_path):
    _checkout(tmp_path)
    first = verdicts.source_fingerprint(tmp_path)
    assert verdicts.source_fingerprint(tmp_path) == first
    (tmp_path / "README.md").write_text("not code\n")               # outside the source folders: no change
    (tmp_path / "dtprobe" / "data.json").write_text("{}\n")          # not Python: no change
    assert verdicts.source_fingerprint(tmp_path) == first
    (tmp_path / "dashboard" / "module.py").write_text("X = 22\n")
    edited = verdicts.source_fingerprint(tmp_path)
    assert edited != first
    (tmp_path / "dtprobe" / "sub").mkdir()
    (tmp_path / "dtprobe" / "sub" / "new.py").write_text("")
    added = verdicts.source_fingerprint(tmp_path)
    assert added != edited
    (tmp_path / "dtprobe" / "sub" / "new.py").unlink()
    assert verdicts.source_fingerprint(tmp_path) == edited


def test_the_matrix_stops_at_the_first_run_during_which_the_sources_changed(tmp_path, monkeypatch, capsys):
    root = tmp_path / "checkout"
    _checkout(root)
    monkeypatch.setattr(verdicts, "ROOT", root)
    ran = []

    def run_scenario(sc, run_dir, args):
        ran.append(sc.label)
        sc.fault_step = args.fault_step
        if len(ran) == 2:                                   # someone edits the checkout during the second run
            (root / "dtprobe" / "module.py").write_text("X = 2  # edited\n")

    monkeypatch.setattr(verdicts, "run_scenario", run_scenario)
    monkeypatch.setattr(verdicts, "analyze", lambda run_dir: {"findings": []})
    monkeypatch.setattr(verdicts, "score", lambda sc, doc, run_dir, nominal_fault_step: verdicts.Outcome(scenario=sc))
    status = verdicts.main(["--layouts", "dp2", "--repeats", "3", "--kinds", "clean", "--step-ms", "0",
                            "--work-dir", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert status == 3
    assert ran == ["clean", "clean"]                        # the third run never started
    assert "[2/3] stopped: dtprobe's sources under" in out
    assert "The 1 runs before it are scored below" in out
    table = out.split("\n\n")[-1]
    assert [line.split()[:2] for line in table.splitlines() if line.startswith(("clean", "overall"))] == \
        [["clean", "1"], ["overall", "1"]]


def test_the_batch_is_the_whole_multiple_of_the_base_nearest_the_target_step_time():
    assert verdicts.scaled_batch(2, 48.0, 200.0) == 8           # 4 x 48 ms = 192 ms
    assert verdicts.scaled_batch(2, 215.0, 200.0) == 2
    assert verdicts.scaled_batch(4, 70.0, 200.0) == 12          # 3 x 70 ms = 210 ms
    assert verdicts.scaled_batch(2, 450.0, 200.0) == 2          # slower than the target: never below the base
    assert verdicts.scaled_batch(2, 0.0, 200.0) == 2


class _StubJob:
    """Stands in for ``harness.Job``: starts nothing, ends at once, and records each job's run folder and command
    (``started``, reset by ``recording``)."""

    started: list[tuple[str, list[str]]] = []

    def __init__(self, *, cmd, run_dir, timeout_s):
        _StubJob.started.append((run_dir.name, cmd))

    @classmethod
    def recording(cls) -> type[_StubJob]:
        cls.started = []
        return cls

    def start(self):
        return self

    def wait(self):
        pass

    def stop(self):
        pass


def _flag(cmd: list[str], name: str) -> str:
    """The value of flag ``name`` in ``cmd``: its last occurrence, as argparse reads it."""
    return cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]


def test_each_layouts_runs_get_its_calibrated_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(verdicts, "Job", _StubJob.recording())
    args = verdicts.argparse.Namespace(steps=40, seq_len=256, batch={"dp2": 8, "dp2xpp2": 12})
    verdicts._run_dtprobe(verdicts.Scenario(kind="clean", layout="dp2"), tmp_path / "a", args)
    verdicts._run_dtprobe(verdicts.Scenario(kind="clean", layout="dp2xpp2"), tmp_path / "b", args, steps=12)
    captured = dict(_StubJob.started)
    assert _flag(captured["a"], "--batch-size") == "8" and _flag(captured["a"], "--steps") == "40"
    assert _flag(captured["b"], "--batch-size") == "12" and _flag(captured["b"], "--steps") == "12"
    assert _flag(captured["b"], "--pp") == "2" and _flag(captured["a"], "--seq-len") == "256"


def test_calibration_measures_each_layout_at_its_base_batch_and_scales_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(verdicts, "Job", _StubJob.recording())
    measured = {"calibrate-dp2": 48.0, "calibrate-dp2xpp2": 70.0}
    monkeypatch.setattr(verdicts, "job_step_ms", lambda run_dir, first, last: measured[run_dir.name])
    args = verdicts.argparse.Namespace(steps=40, seq_len=256, step_ms=200.0, layouts=["dp2", "dp2xpp2"],
                                       work_dir=tmp_path)
    assert verdicts.calibrate(args) == {**verdicts.BASE_BATCH, "dp2": 8, "dp2xpp2": 12}
    assert [(name, _flag(cmd, "--batch-size")) for name, cmd in _StubJob.started] == \
        [("calibrate-dp2", "2"), ("calibrate-dp2xpp2", "4")]
    assert "[calibrate] dp2: steps of 48 ms at batch 2 -> batch 8\n" in capsys.readouterr().out
    args.step_ms = 0
    assert verdicts.calibrate(args) == verdicts.BASE_BATCH


def test_a_calibration_run_without_steps_ends_the_matrix_with_its_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(verdicts, "Job", _StubJob.recording())
    monkeypatch.setattr(verdicts, "job_step_ms", lambda run_dir, first, last: None)
    monkeypatch.setattr(verdicts, "run_scenario", lambda *a: pytest.fail("no scenario may run"))
    status = verdicts.main(["--layouts", "dp4", "--kinds", "clean", "--work-dir", str(tmp_path)])
    assert status == 2
    assert "calibration failed: the calibration run of dp4 in" in capsys.readouterr().err
