"""The clock offset re-measured while a job runs (``dtprobe.collectors.clock.ClockResync``): two real gloo ranks in
separate processes, told they are on different machines (``DTPROBE_CLOCK_ID``), write ``clock`` rows at a tiny
interval and stop cleanly at close; a dead peer ends the thread with one "failed" row; a hung peer does not hold
up close or the process's exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from dtprobe.collectors.clock import RESYNC_TIMEOUT_S
from dtprobe.store import RunStore

_RANK = r"""
import json, os, sys, time
import torch, torch.distributed as dist
import dtprobe
run_dir, mode = sys.argv[1], sys.argv[2]
probe = dtprobe.attach(run_dir, timeout_s=60, clock_interval_s=0.2, devices=False)
rank = probe.rank
if mode == "dead" and rank == 1:
    os._exit(0)                                   # a rank that dies without closing
if mode == "hung" and rank == 1:
    print(json.dumps({"ready": True}), flush=True)
    time.sleep(600)                               # the test stops this process (SIGSTOP) and kills it
out = {}
if mode == "clean":
    for step in range(6):
        with probe.step(step):
            t = torch.ones(4)
            dist.all_reduce(t)
            time.sleep(0.25)
elif mode == "destroyed":
    with probe.step(0):
        dist.all_reduce(torch.ones(4))
    dist.barrier()
    dist.destroy_process_group()                  # before close, as many scripts do: the clock group goes too
    time.sleep(1.0)
elif mode == "dead":
    deadline = time.monotonic() + 30
    while probe._clock.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    out["thread_ended"] = not probe._clock.alive
elif mode == "hung":
    time.sleep(float(sys.argv[3]))                # rank 1 is stopped now: the thread waits on it
t0 = time.monotonic()
probe.close()
out["close_s"] = time.monotonic() - t0
out["alive_after_close"] = probe._clock.alive
out["closed_at"] = time.time()
print(json.dumps(out), flush=True)
"""


def start_ranks(start_python, child_env, free_port, run_dir, mode, *extra):
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port, DTPROBE_CLOCK_ID=f"machine{rank}")
        procs.append(start_python(_RANK, run_dir, mode, *extra, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.multiproc
@pytest.mark.exclusive
def test_clock_thread_writes_remeasured_offsets_and_stops_at_close(tmp_path, start_python, child_env, free_port):
    run = tmp_path / "run"
    procs = start_ranks(start_python, child_env, free_port, run, "clean")
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    for r in results:
        assert r["alive_after_close"] is False and r["close_s"] < 2.0
    clock = RunStore.open(run).table("clock")
    r0, r1 = clock[clock["rank"] == 0], clock[clock["rank"] == 1]
    assert r0["event"].tolist() == ["attach"] and r0["offset_ns"].tolist() == [0]   # rank 0: its own clock
    assert r1["event"].iloc[0] == "attach"
    remeasured = r1[r1["event"] == "remeasure"]
    assert len(remeasured) >= 3                     # 6 steps of 0.25 s with a 0.2 s interval
    assert (clock["event"] != "failed").all()
    # one machine, so the true offset is 0: each measured one is within its round trip
    assert (remeasured["rtt_ns"] > 0).all()
    assert (remeasured["offset_ns"].abs() <= remeasured["rtt_ns"]).all()
    assert remeasured["time_ns"].is_monotonic_increasing
    # the ping-pongs ran on the clock's own group, paused: none is among the job's recorded collectives
    coll = RunStore.open(run).table("collectives")
    assert set(coll["op"]) == {"allreduce"} and len(coll) == 12


def test_clock_interval_must_not_be_negative():
    from dtprobe.collectors.config import CollectConfig
    from dtprobe.store.errors import ConfigError

    with pytest.raises(ConfigError, match=r"collect.clock_interval_s = -1.*0 measures the clock offset at attach"):
        CollectConfig(clock_interval_s=-1)


@pytest.mark.multiproc
@pytest.mark.exclusive
def test_clock_thread_ends_quietly_when_the_script_destroys_its_groups_before_close(tmp_path, start_python,
                                                                                  child_env, free_port):
    run = tmp_path / "run"
    procs = start_ranks(start_python, child_env, free_port, run, "destroyed")
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    assert all(json.loads(o[0].strip().splitlines()[-1])["alive_after_close"] is False for o in outs)
    clock = RunStore.open(run).table("clock")
    assert (clock["event"] != "failed").all(), clock.to_dict(orient="records")
    assert clock["event"].tolist().count("attach") == 2


@pytest.mark.multiproc
@pytest.mark.exclusive
def test_clock_thread_ends_with_one_failed_row_when_its_peer_dies(tmp_path, start_python, child_env, free_port):
    run = tmp_path / "run"
    procs = start_ranks(start_python, child_env, free_port, run, "dead")
    outs = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 0, outs[0][1][-3000:]
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    assert result["thread_ended"] is True and result["close_s"] < 2.0
    clock = RunStore.open(run).table("clock")
    failed = clock[clock["event"] == "failed"]
    assert failed["rank"].tolist() == [0] and failed["offset_ns"].isna().all()
    assert failed["detail"].iloc[0].startswith("clock re-measurement stopped at round")


@pytest.mark.multiproc
@pytest.mark.exclusive
def test_close_and_exit_do_not_wait_for_a_clock_thread_stuck_on_a_hung_peer(tmp_path, start_python, child_env,
                                                                            free_port):
    run = tmp_path / "run"
    procs = start_ranks(start_python, child_env, free_port, run, "hung", "1.5")
    assert json.loads(procs[1].stdout.readline()) == {"ready": True}
    os.kill(procs[1].pid, signal.SIGSTOP)           # hung: alive, connected, never answers
    try:
        out, err = procs[0].communicate(timeout=60)
        exited_at = time.time()
    finally:
        procs[1].kill()
    assert procs[0].returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["close_s"] < 2.0 and result["alive_after_close"] is True   # left stuck on the peer
    print(f"exit {exited_at - result['closed_at']:.2f} s after close")
    assert exited_at - result["closed_at"] < RESYNC_TIMEOUT_S / 2   # the exit did not wait out the group's timeout
