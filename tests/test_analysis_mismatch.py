"""COLLECTIVE_MISMATCH (a member issued another op/dtype/size, or skipped a collective), CHECKPOINT_CORRUPT, and the
rule that a finding with a 0% predicted gain is ``info``; on small hand-made runs."""

from __future__ import annotations

import json

import pytest
from analysis_synth import (MS, T0, cut_rank, frames, lockstep_tables, pending_row, stall_rank, write_rows_run)

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.findings import Finding, PredictedGain, info_without_gain
from dtprobe.analysis.mismatch import collective_mismatches, detect_mismatches


def _codes(a: RunAnalysis, *codes: str) -> list:
    return [f for f in a.findings() if f.code in codes]


def _wrong_op_job(*, world: int, odd: int, at_step: int = 3, **row) -> dict:
    """Every rank all-reduces once per step; at ``at_step`` rank ``odd`` issues ``row`` (e.g. op=broadcast)
    instead; nobody finishes that call and the job dies on the timeout 10 s later."""
    rows = lockstep_tables(world=world, num_steps=6)
    t = T0 + at_step * 100 * MS
    rows["pending"] = []
    for r in range(world):
        stall_rank(rows, r, t + 60 * MS, until_ns=t + 10_000 * MS, close=("crashed", "exception"))
        p = pending_row(r, step=at_step, seq=at_step + 1, t_ns=t + (60 + r) * MS, world=world)
        rows["pending"].append({**p, **row} if r == odd else p)
    return rows


def _timeout_attempt(world: int) -> list[dict]:
    err = {"type": "torch.distributed.DistBackendError", "message": "[gloo] Timed out waiting 10000ms for recv",
           "traceback": "..."}
    return [{"attempt": 0, "node_rank": 0, "result": "failed", "ranks": [
        {"rank": r, "exit_code": 1, "signal": None, "first_failure": r == 0, "time_ns": T0 + 10_400 * MS,
         "error": err} for r in range(world)]}]


def test_a_rank_issuing_another_collective_is_a_mismatch_not_a_hang_straggler_or_crash(tmp_path):
    rows = _wrong_op_job(world=2, odd=1, op="broadcast")
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed",
                                        attempts=_timeout_attempt(2)))
    [f] = _codes(a, "COLLECTIVE_MISMATCH")
    ev = f.evidence
    assert (f.ranks, f.severity, f.group, ev["kind"], ev["seq"], ev["step"]) == ((1,), "critical", "dp", "different",
                                                                                4, 3)
    assert ev["issued"] == {"0": {"op": "allreduce", "dtype": "float32", "num_bytes": 4 << 20, "step": 3},
                            "1": {"op": "broadcast", "dtype": "float32", "num_bytes": 4 << 20, "step": 3}}
    assert ev["expected"]["op"] == "allreduce"
    assert ev["phase"] == "bwd"                       # 61 ms into the step: data 10 + fwd 30 <= 61 < + bwd 40
    assert _codes(a, "HANG", "STRAGGLER", "RANK_CRASH") == []


def test_of_two_ranks_the_one_whose_call_falls_between_steps_is_odd_against_the_one_repeating_its_step(tmp_path):
    # rank 0 logs with a barrier under `if rank == 0:` after step 2; rank 1 went on into step 3's all-reduce,
    # the call it made at that place of step 2. Rank 0 is the odd one, though its call has no step to compare
    rows = _wrong_op_job(world=2, odd=0, op="barrier", num_bytes=0, step=-1)
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed",
                                        attempts=_timeout_attempt(2)))
    [f] = _codes(a, "COLLECTIVE_MISMATCH")
    assert (f.ranks, f.evidence["step"], f.evidence["expected"]["op"]) == ((0,), -1, "allreduce")
    assert "(outside any step)" in f.title and "outside the training steps" in f.recommendation


@pytest.mark.parametrize("row,what", [(dict(dtype="float16"), "dtype"), (dict(num_bytes=1 << 20), "num_bytes")])
def test_the_minority_member_is_the_odd_rank_when_dtype_or_size_differs(tmp_path, row, what):
    rows = _wrong_op_job(world=4, odd=2, **row)
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=4, status="crashed"))
    [f] = _codes(a, "COLLECTIVE_MISMATCH")
    assert f.ranks == (2,) and f.evidence["issued"]["2"][what] == row[what]
    assert f.evidence["expected"][what] != row[what]


def test_a_rank_that_skipped_a_collective_is_named_and_the_shift_is_seen():
    # two calls per step (all-reduce 4 MiB, then all-gather 1 MiB); rank 1 skips step 3's all-gather, so from
    # seq 8 on it issues the others' seq 9, 10, ...
    rows = {"collectives": []}
    for r in range(2):
        seq = 0
        for step in range(6):
            for op, size in (("allreduce", 4 << 20), ("allgather", 1 << 20)):
                if r == 1 and step == 3 and op == "allgather":
                    continue
                seq += 1
                t = T0 + (step * 100 + (60 if op == "allreduce" else 80)) * MS
                rows["collectives"].append({"rank": r, "pg": "dp", "pg_ranks": "0,1", "pg_size": 2, "seq": seq,
                                            "op": op, "num_bytes": size, "dtype": "float32", "enqueue_ns": t,
                                            "end_ns": t + 5 * MS, "step": step, "restart": 0})
    f = frames(rows)
    [m] = collective_mismatches(f["collectives"], f["steps"]).itertuples()
    assert (m.kind, m.odd_ranks, m.seq, m.expected["op"], m.issued["1"]["op"]) == ("skipped", [1], 8, "allgather",
                                                                                  "allreduce")
    assert m.step == 3                # where the others issued the all-gather it skipped, not its step-4 call


def test_a_skip_among_identical_calls_is_found_from_the_step_counts():
    rows = lockstep_tables(world=2, num_steps=6)
    coll = [x for x in rows["collectives"] if not (x["rank"] == 1 and x["step"] == 3)]
    for x in coll:
        if x["rank"] == 1 and x["step"] > 3:
            x["seq"] -= 1                                 # rank 1 numbers its later calls one lower
    f = frames({**rows, "collectives": coll})
    [m] = collective_mismatches(f["collectives"], f["steps"]).itertuples()
    assert (m.kind, m.odd_ranks, m.seq, m.step) == ("skipped", [1], 4, 3)
    [finding] = detect_mismatches(collective_mismatches(f["collectives"], f["steps"]))
    assert "(step 3" in finding.title and "find_unused_parameters=True" in finding.recommendation


def test_a_call_at_a_step_boundary_numbered_one_step_apart_is_no_mismatch():
    rows = lockstep_tables(world=2, num_steps=6)
    for x in rows["collectives"]:
        if x["rank"] == 1:
            x["step"] += 1                                # same calls, rank 1 counts its steps from 1
    f = frames(rows)
    assert collective_mismatches(f["collectives"], f["steps"]).empty



def test_calls_of_another_thread_numbered_with_a_later_step_are_no_skip():
    # an asynchronous checkpoint's collectives (the same three calls on every member at each save) are issued by a
    # thread of their own: rank 0's training thread sometimes moved on to the next step before its third call, so
    # rank 0 made fewer calls than rank 1 in step k and more in step k + 1, the same number over both
    rows = {"collectives": []}
    seq = 0
    for save, k in enumerate((2, 5, 8)):
        for i, (op, size) in enumerate((("allgather", 16), ("gather", 4096), ("broadcast", 8))):
            seq += 1
            for r in range(2):
                step = k + 1 if (r == 0 and i == 2 and save != 1) else k
                t = T0 + (k * 100 + 20 * i + r) * MS
                rows["collectives"].append({"rank": r, "pg": "ckpt", "pg_ranks": "0,1", "pg_size": 2, "seq": seq,
                                            "op": op, "num_bytes": size, "dtype": "int64", "enqueue_ns": t,
                                            "end_ns": t + 5 * MS, "step": step, "restart": 0})
    f = frames(rows)
    assert collective_mismatches(f["collectives"], f["steps"]).empty


def test_calls_of_another_thread_behind_up_to_the_last_step_are_no_skip_when_every_call_was_made():
    # a save in every step, rank 0's third call of each numbered with the next step: rank 0 is behind at the end
    # of every step both ranks have rows in, but it made all 9 calls, as rank 1 did
    rows = {"collectives": []}
    seq = 0
    for k in (2, 3, 4):
        for i, op in enumerate(("allgather", "gather", "broadcast")):
            seq += 1
            for r in range(2):
                t = T0 + (k * 100 + 20 * i + r) * MS
                rows["collectives"].append({"rank": r, "pg": "ckpt", "pg_ranks": "0,1", "pg_size": 2, "seq": seq,
                                            "op": op, "num_bytes": 8, "dtype": "int64", "enqueue_ns": t,
                                            "end_ns": t + 5 * MS, "step": k + 1 if (r == 0 and i == 2) else k,
                                            "restart": 0})
    f = frames(rows)
    assert collective_mismatches(f["collectives"], f["steps"]).empty


def test_a_clean_run_has_no_mismatch():
    f = frames(lockstep_tables(world=4, num_steps=8))
    assert collective_mismatches(f["collectives"], f["steps"]).empty


def _corrupt(rank: int, *, fallback, injected: bool = False) -> dict:
    return {"rank": rank, "time_ns": T0 + 50 * MS, "step": 4, "kind": "corrupt-ckpt", "injected": injected,
            "detail": json.dumps({"path": "/ckpt/step_00004", "file": "__0_0.distcp", "ckpt_step": 4,
                                  "reason": "checksum mismatch", "fallback_step": fallback})}


@pytest.mark.parametrize("fallback,severity", [(2, "warning"), (None, "critical")])
def test_checkpoint_corrupt_names_file_step_finder_and_recovery(tmp_path, fallback, severity):
    faults = [_corrupt(0, fallback=fallback), _corrupt(1, fallback=fallback)]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", lockstep_tables(world=2, num_steps=3), world_size=2,
                                        status="finished", faults=faults))
    [f] = _codes(a, "CHECKPOINT_CORRUPT")
    ev = f.evidence
    assert (f.severity, f.ranks, ev["file"], ev["ckpt_step"], ev["fallback_step"]) == (
        severity, (0, 1), "__0_0.distcp", 4, fallback)
    assert ev["steps_lost"] == (2 if fallback is not None else None) and ev["injected"] is False


def test_an_injected_corrupt_checkpoint_row_alone_is_no_finding(tmp_path):
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", lockstep_tables(world=2, num_steps=3), world_size=2,
                                        status="finished", faults=[_corrupt(0, fallback=2, injected=True)]))
    assert _codes(a, "CHECKPOINT_CORRUPT") == []


@pytest.mark.parametrize("frac,severity", [(0.004, "info"), (-0.004, "info"), (0.005, "warning"), (0.2, "warning")])
def test_a_finding_whose_gain_rounds_to_zero_is_info(frac, severity):
    f = Finding(code="STRAGGLER", severity="warning", ranks=(1,), group="dp", title="t", evidence={},
                recommendation="r", predicted_gain=PredictedGain(metric="step_time", frac=frac))
    [g] = info_without_gain([f])
    assert g.severity == severity
    no_gain = Finding(code="HANG", severity="critical", ranks=(1,), group="dp", title="t", evidence={},
                      recommendation="r")
    assert info_without_gain([no_gain]) == [no_gain]       # no predicted gain: the severity stands


def test_all_to_all_with_uneven_splits_is_no_mismatch():
    rows = lockstep_tables(world=2, num_steps=4)
    for x in rows["collectives"]:
        x["op"], x["num_bytes"] = "alltoall", (1 << 20) * (1 + x["rank"])    # each rank sends its own split
    f = frames(rows)
    assert collective_mismatches(f["collectives"], f["steps"]).empty


def _ended_early_job(*, close: tuple[str, str] | None = ("finished", "exit")) -> dict:
    """3 ranks all-reduce once per step; rank 2 runs out of data after step 3 and its script returns (its probe
    closes ``close``), while ranks 0 and 1 enter step 4's all-reduce (seq 5) and fail 0.4 s later when the
    connection to rank 2 closes."""
    rows = lockstep_tables(world=3, num_steps=6)
    t = T0 + 4 * 100 * MS
    cut_rank(rows, 2, t)
    if close is not None:
        rows["lifecycle"].append({"rank": 2, "restart": 0, "time_ns": t + 2 * MS, "event": "close",
                                  "status": close[0], "reason": close[1], "pid": 102})
    rows["pending"] = []
    for r in (0, 1):
        stall_rank(rows, r, t + 60 * MS, until_ns=t + 460 * MS, close=("crashed", "exception"))
        rows["pending"].append(pending_row(r, step=4, seq=5, t_ns=t + (60 + r) * MS, world=3))
    return rows


def _closed_peer_attempt(end_code: int | None) -> list[dict]:
    err = {"type": "RuntimeError", "message": "[gloo] Connection closed by peer [127.0.0.1]:4242", "traceback": "..."}
    ranks = [{"rank": r, "exit_code": 1, "signal": None, "first_failure": r == 0, "time_ns": T0 + 870 * MS,
              "error": err} for r in (0, 1)]
    ranks.append({"rank": 2, "exit_code": end_code, "signal": None, "first_failure": False,
                  "time_ns": T0 + 405 * MS, "error": None})
    return [{"attempt": 0, "node_rank": 0, "result": "failed", "ranks": ranks}]


@pytest.mark.parametrize("launcher", [True, False])
def test_a_rank_that_ended_while_its_peers_waited_is_a_mismatch_not_a_hang_or_crash(tmp_path, launcher):
    # under dtprobe launch the launcher saw it exit with code 0; under plain torchrun its probe's close says it
    rows = _ended_early_job()
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=3, status="crashed",
                                        attempts=_closed_peer_attempt(0) if launcher else None))
    [f] = _codes(a, "COLLECTIVE_MISMATCH")
    ev = f.evidence
    assert (f.ranks, f.severity, ev["kind"], ev["seq"], ev["step"], ev["odd_ranks"]) == (
        (2,), "critical", "ended", 5, 4, [2])
    assert ev["issued"] == {str(r): {"op": "allreduce", "dtype": "float32", "num_bytes": 4 << 20, "step": 4}
                            for r in (0, 1)}
    assert ev["ended"]["2"]["last_step"] == 3 and ev["ended"]["2"]["steps_behind"] == 1
    assert ev["ended"]["2"]["exit_code"] == (0 if launcher else None)
    assert "rank 2 " + ("exited with code 0" if launcher else "closed normally") + " after step 3" in f.title
    assert "uneven data" in f.recommendation
    assert _codes(a, "HANG", "STRAGGLER", "RANK_CRASH") == []


def _after_the_loop_job(*, odd_steps: int) -> dict:
    """2 ranks all-reduce once per step for 6 steps; rank 1 runs ``odd_steps`` of them and its script returns
    (probe closed finished), while rank 0, after its last step, all-reduces a metric outside any step (step -1,
    seq 7: the collective under ``if rank == 0:``) and fails when the connection to rank 1 closes."""
    rows = lockstep_tables(world=2, num_steps=6)
    t_end = T0 + odd_steps * 100 * MS
    cut_rank(rows, 1, t_end)
    rows["lifecycle"].append({"rank": 1, "restart": 0, "time_ns": t_end + 2 * MS, "event": "close",
                              "status": "finished", "reason": "exit", "pid": 101})
    stall_rank(rows, 0, T0 + 601 * MS, until_ns=T0 + 1000 * MS, close=("crashed", "exception"))
    rows["pending"] = [pending_row(0, step=-1, seq=7, t_ns=T0 + 605 * MS, num_bytes=4)]
    return rows


@pytest.mark.parametrize("odd_steps,behind", [(6, 0), (5, 1)])
def test_a_rank_that_ended_while_a_peer_waited_in_a_collective_after_the_loop_is_an_ended_mismatch(
        tmp_path, odd_steps, behind):
    # rank 1 ran every step (or one fewer) and returned; rank 0's all-reduce after the loop is in no step: the
    # others' place is the step after their last one, which rank 1 never began. Not a HANG naming a frozen rank
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", _after_the_loop_job(odd_steps=odd_steps), world_size=2,
                                        status="crashed"))
    [f] = _codes(a, "COLLECTIVE_MISMATCH")
    ev = f.evidence
    assert (f.ranks, ev["kind"], ev["seq"], ev["step"]) == ((1,), "ended", 7, -1)
    assert ev["ended"]["1"]["last_step"] == odd_steps - 1 and ev["ended"]["1"]["steps_behind"] == behind
    assert "(outside any step)" in f.title and "step -1" not in f.title
    # the same steps: a collective only rank 0 reaches; fewer steps: uneven data
    assert ("if rank == 0:" in f.recommendation) == (behind == 0)
    assert ("uneven data" in f.recommendation) == (behind > 0)
    assert _codes(a, "HANG", "STRAGGLER", "RANK_CRASH") == []


def test_a_rank_that_finished_the_step_of_a_collective_only_a_peer_issued_and_ended_is_an_ended_mismatch(tmp_path):
    # rank 0 all-reduces a metric on the "log" group in its last step under `if rank == 0:`; rank 1 finished that
    # step too and returned: it went past the others' step, and never issued the call
    rows = lockstep_tables(world=2, num_steps=6)
    stall_rank(rows, 0, T0 + 571 * MS, until_ns=T0 + 3000 * MS, close=("crashed", "exception"))
    rows["pending"] = [pending_row(0, step=5, seq=1, t_ns=T0 + 575 * MS, pg="log", num_bytes=4)]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed"))
    [f] = _codes(a, "COLLECTIVE_MISMATCH")
    ev = f.evidence
    assert (f.ranks, ev["kind"], ev["pg"], ev["step"]) == ((1,), "ended", "log", 5)
    assert ev["ended"]["1"]["last_step"] == 5 and ev["ended"]["1"]["steps_behind"] == 0
    assert "if rank == 0:" in f.recommendation and "(step 5)" in f.title
    assert _codes(a, "HANG", "RANK_CRASH") == []


@pytest.mark.parametrize("close,end_code", [(None, -9), (("crashed", "SIGTERM"), -15), (None, None)])
def test_a_rank_that_did_not_end_on_its_own_is_no_ended_mismatch(tmp_path, close, end_code):
    # killed (no close), SIGTERMed from outside, or gone without a word: its record may be cut short, so nothing
    # says it never issued the collective
    rows = _ended_early_job(close=close)
    attempts = _closed_peer_attempt(end_code)
    if end_code is not None and end_code < 0:
        attempts[0]["ranks"][-1].update(exit_code=None, signal="SIGKILL" if end_code == -9 else "SIGTERM")
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=3, status="crashed", attempts=attempts))
    assert _codes(a, "COLLECTIVE_MISMATCH") == []
    assert _codes(a, "HANG", "RANK_CRASH")


def test_calls_that_line_up_unshifted_are_no_skip_whatever_the_step_counts():
    # an asynchronous checkpoint's group: its calls are numbered with whatever step the training thread is in.
    # Rank 1 numbered its second call one step later (behind from step 4 on), then its script returned without
    # awaiting its last save: its gather #4 ran outside any step (-1), and it never issued broadcast #5, where
    # rank 0 waits. Its calls are rank 0's, call for call: nothing was skipped, it ended
    rows = lockstep_tables(world=2, num_steps=6)
    calls = {0: ((3, "allgather"), (4, "gather"), (5, "allgather"), (5, "gather"), (5, "broadcast")),
             1: ((3, "allgather"), (5, "gather"), (5, "allgather"), (-1, "gather"))}
    for r, made in calls.items():
        for seq, (step, op) in enumerate(made, start=1):
            at = T0 + (step * 100 + 90 if step >= 0 else 590) * MS
            rows["collectives"].append({"rank": r, "pg": "ckpt", "pg_ranks": "0,1", "pg_size": 2, "seq": seq,
                                        "op": op, "num_bytes": 16, "dtype": "uint8", "enqueue_ns": at + r * MS,
                                        "end_ns": None if seq == 5 else at + 3 * MS, "step": step, "timing": "host",
                                        "restart": 0})
    f = frames(rows)
    assert collective_mismatches(f["collectives"], f["steps"]).empty


def _aborted_receiver_attempt(world: int, aborted: int) -> list[dict]:
    """gloo's size check aborted ``aborted`` (SIGABRT) first; the others then failed on the closed connection."""
    err = {"type": "RuntimeError", "message": "[gloo] Connection closed by peer", "traceback": "..."}
    return [{"attempt": 0, "node_rank": 0, "result": "failed", "ranks": [
        {"rank": r, "exit_code": None if r == aborted else 1, "signal": 6 if r == aborted else None,
         "first_failure": r == aborted, "time_ns": T0 + (360 if r == aborted else 900) * MS,
         "error": None if r == aborted else err} for r in range(world)]}]


def test_a_size_mismatch_the_labels_round_alike_names_bytes_the_silent_member_and_the_abort_it_caused(tmp_path):
    # rank 2 all-reduces 4 KiB more than its peers at step 3; rank 1, receiving the larger message, aborted inside
    # the call before its row reached disk. The title gives exact sizes (both read "4.0 MiB"), names the member
    # with no record, and the header tells rank 1's abort as this mismatch's consequence, not as a second fault
    rows = _wrong_op_job(world=4, odd=2, num_bytes=(4 << 20) + 4096)
    rows["pending"] = [p for p in rows["pending"] if p["rank"] != 1]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=4, status="crashed",
                                        attempts=_aborted_receiver_attempt(4, aborted=1)))
    [f] = _codes(a, "COLLECTIVE_MISMATCH")
    assert f.ranks == (2,) and f.evidence["kind"] == "different"
    assert "issued allreduce (float32, 4,198,400 B) where rank(s) [0, 3] issued allreduce (float32, 4,194,304 B)" \
        in f.title
    assert f.title.endswith("; rank(s) [1] left no record of it")
    assert "4,096 bytes more" in f.recommendation and "Received data size" in f.recommendation
    assert _codes(a, "HANG", "STRAGGLER", "RANK_CRASH") == []
    [c] = a.report()["metrics"]["run"]["crashes"]
    assert (c["rank"], c["signal"], c["restart"], c["explained_by"]) == (1, 6, 0, "COLLECTIVE_MISMATCH")
    assert c["title"].startswith("rank 1 died") and c["title"].endswith("(a consequence of the COLLECTIVE_MISMATCH)")


def test_a_size_mismatch_whose_labels_differ_keeps_them_rounded():
    import pandas as pd

    mine = {"op": "allreduce", "dtype": "float32", "num_bytes": 2 << 20, "step": 3}
    theirs = {**mine, "num_bytes": 1 << 20}
    m = pd.DataFrame([{"pg": "0", "pg_ranks": "0,1", "restart": 0, "seq": 4, "kind": "different", "odd_ranks": [1],
                       "issued": {"0": theirs, "1": mine}, "expected": theirs, "step": 3, "phase": "bwd",
                       "ended": None}])
    [f] = detect_mismatches(m)
    assert "issued allreduce (float32, 2 MiB) where rank(s) [0] issued allreduce (float32, 1 MiB)" in f.title
    assert "left no record" not in f.title and "1,048,576 bytes more" in f.recommendation


def test_an_all_gather_against_a_reduce_scatter_names_the_rank_still_gathering_as_running_more_sharded_modules():
    import pandas as pd

    # an FSDP2 job whose rank 1 built one block more: at call #6 of step 0 it still all-gathers a block's
    # parameters where rank 0 reduce-scatters its first gradients; two ranks, so no majority names the odd one
    gather = {"op": "allgather", "dtype": "float32", "num_bytes": 33664, "step": 0}
    reduce = {**gather, "op": "reduce_scatter"}
    m = pd.DataFrame([{"pg": "world", "pg_ranks": "0,1", "restart": 0, "seq": 6, "kind": "different",
                       "odd_ranks": [0, 1], "issued": {"0": reduce, "1": gather}, "expected": None, "step": 0,
                       "phase": None, "ended": None}])
    [f] = detect_mismatches(m)
    assert "rank 0 reduce_scatter (float32, 32.9 KiB); rank 1 allgather (float32, 32.9 KiB)" in f.title
    assert ("Rank(s) [1] still gathered parameters" in f.recommendation
            and "more on rank(s) [1] or fewer on rank(s) [0]" in f.recommendation)
    other = m.assign(issued=[{"0": {**gather, "op": "broadcast"}, "1": gather}])
    assert "still gathered" not in detect_mismatches(other)[0].recommendation
