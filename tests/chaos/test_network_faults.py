"""Network faults with real networking: two nodes as Linux network namespaces joined by one veth pair
(``netns.py``), one ``dtprobe run --nnodes 2`` launcher and one rank in each, the run directory on the shared
filesystem. The fault is caused on the link from outside the job, mid-run, and ``dtprobe analyze RUN --format json``
must name it:

- the link rate-limited with ``tc ... tbf``: SLOW_LINK naming both nodes, with a bus bandwidth after the change
  that the shaped rate bounds, and no STRAGGLER blamed on compute;
- the link taken down (a partition): HANG with ``cause: "network"``, the two sides, and both ranks ``waiting``.

Needs root and iproute2 (``ip``, ``tc``) and util-linux (``unshare``); a missing one fails the test with the fix.
Set ``DTPROBE_CHAOS_RUNS=/some/dir`` to keep the run directories (``net_slow``, ``net_partition``) there.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import netns
from dtprobe.store import RunStore
from harness import (analyze, assert_only_confirmed_stragglers, findings_of, is_alive, read_rank, scenario_dir,
                     summary)

pytestmark = [pytest.mark.multiproc, pytest.mark.chaos, pytest.mark.exclusive]

TINY = ("--batch-size", "2", "--seq-len", "16", "--device-interval", "0.5")
"""The tiny model (3.6 MB of gradients all-reduced per step: enough for the shaped link to matter), small batches."""
LAUNCH_TIMEOUT_S = 150
"""Outer bound of each launcher; what still runs in the namespaces afterwards is killed by the fixture."""
SHAPED_RATE_BITS_PER_S = 100e6
SHAPED_RATE = "100mbit"


@pytest.fixture
def two_nodes(request) -> netns.TwoNodes:
    """The two namespaces, removed (with every process left in them and their /etc/netns files) when the test
    ends, also when it fails."""
    missing = netns.missing_preconditions()
    if missing:
        pytest.fail("the network chaos tests cannot run here: " + "; ".join(missing), pytrace=False)
    link = netns.TwoNodes()

    def remove() -> None:
        problems = link.destroy()
        assert not problems, f"network namespace cleanup: {problems}"

    request.addfinalizer(remove)
    return link.create()


def _logs(run_dir: Path) -> Path:
    return run_dir.parent / f"{run_dir.name}.launchers"


def _tail(run_dir: Path) -> str:
    """The end of both launchers' output and torchrun logs: what an assertion message shows."""
    out = []
    for path in sorted(_logs(run_dir).glob("*.log")) + sorted((run_dir / "logs").glob("torchrun.node*.log")):
        out.append(f"--- {path}\n" + path.read_text(errors="replace")[-1500:])
    return "\n".join(out)


def _step_running_at(run_dir: Path, *, rank: int, time_ns: int) -> int:
    """The first step of ``rank`` that ended after ``time_ns``."""
    steps = RunStore.open(run_dir, tables=["steps"]).table("steps")
    later = steps[(steps["rank"] == rank) & (steps["end_ns"] > time_ns)]
    assert len(later), f"rank {rank} has no step ending after the fault"
    return int(later["step"].min())


def test_rate_limited_link_mid_run_gives_slow_link_naming_both_nodes(two_nodes, tmp_path):
    run_dir = scenario_dir("net_slow", tmp_path)
    # 50 steps: a tiny-model step is short, so the run can be past step 25 before tc's shaping bites, and at
    # least 10 steps must cross the shaped link for SLOW_LINK's change point
    procs = two_nodes.dtprobe_run(run_dir, ["--steps", "50", "--timeout", "60", *TINY], logs=_logs(run_dir))
    netns.wait_for_rows(run_dir / "events/steps/rank00000.jsonl", num_rows=15, timeout_s=LAUNCH_TIMEOUT_S,
                        procs=procs)
    # tbf on both veth ends: the all-reduce's ring sends the same bytes in each direction.
    shaped_from_ns = time.time_ns()
    two_nodes.rate_limit(rate=SHAPED_RATE, burst="64kb", latency="50ms")
    shaped_by_ns = time.time_ns()
    codes = netns.wait_all(procs, timeout_s=LAUNCH_TIMEOUT_S)
    assert codes == [0, 0], _tail(run_dir)
    # The steps rank 0 was running while the shaping started (one host clock: the namespaces share it).
    first, last = (_step_running_at(run_dir, rank=0, time_ns=t) for t in (shaped_from_ns, shaped_by_ns))

    doc = analyze(run_dir)
    slow = findings_of(doc, "SLOW_LINK")
    assert len(slow) == 1, summary(doc)
    ev = slow[0]["evidence"]
    hosts = sorted(n.hostname for n in two_nodes.nodes)
    assert sorted(ev["nodes"]) == hosts and sorted(slow[0]["ranks"]) == [0, 1]
    # That step's all-reduce may have crossed the link before or after the shaping began.
    assert first <= ev["changed_at_step"] <= last + 1, (ev, first, last)
    # Payload over the shaped link cannot beat its rate (2 ranks: busbw = bytes each way / transfer time).
    assert ev["busbw_after_gbps"] <= SHAPED_RATE_BITS_PER_S / 1e9, ev
    assert ev["busbw_after_gbps"] < 0.5 * ev["busbw_before_gbps"], ev
    # the link's slowness is not blamed on a rank's compute (a straggler the steps confirm may stand)
    assert_only_confirmed_stragglers(run_dir, {"findings": [f for f in findings_of(doc, "STRAGGLER")
                                                            if f["evidence"].get("cause") == "compute"]},
                                     ("STRAGGLER",))


def test_link_down_mid_run_gives_network_hang_with_both_sides_waiting(two_nodes, tmp_path):
    collective_timeout_s, pg_timeout_s = 8, 20
    run_dir = scenario_dir("net_partition", tmp_path)
    node0, node1 = two_nodes.nodes
    procs = two_nodes.dtprobe_run(run_dir, ["--steps", "40", "--timeout", str(pg_timeout_s), "--collective-timeout",
                                            str(collective_timeout_s), *TINY], logs=_logs(run_dir))
    netns.wait_for_rows(run_dir / "events/steps/rank00000.jsonl", num_rows=10, timeout_s=LAUNCH_TIMEOUT_S,
                        procs=procs)
    two_nodes.link_down(node1)
    cut = time.monotonic()
    # Node 0 ends on its own: its watchdog fires after --collective-timeout, its launcher marks the run crashed.
    assert netns.wait_all(procs[:1], timeout_s=collective_timeout_s + 60) == [1], _tail(run_dir)
    # Node 1's rank ends on its own too, at the process-group timeout (gloo gives up on the collective) ...
    rank1 = read_rank(run_dir, 1)
    assert rank1 is not None, _tail(run_dir)
    while is_alive(int(rank1["pid"])):
        assert time.monotonic() < cut + pg_timeout_s + 40, f"rank 1 outlived --timeout {pg_timeout_s}\n{_tail(run_dir)}"
        time.sleep(0.25)
    # ... but its torchrun agent waits on node 0's rendezvous store behind the cut link: heal the link so it
    # learns that node 0 is gone.
    two_nodes.link_up(node1)
    netns.wait_all(procs[1:], timeout_s=60)

    doc = analyze(run_dir)
    hangs = findings_of(doc, "HANG")
    assert len(hangs) == 1, summary(doc) + "\n" + _tail(run_dir)
    hang = hangs[0]
    ev = hang["evidence"]
    assert hang["severity"] == "critical" and ev["cause"] == "network", (summary(doc), ev)
    assert ev["sides"] == {"node0": [0], "node1": [1]}, ev
    assert ev["liveness"] == {"0": "waiting", "1": "waiting"}, ev
    assert sorted(hang["ranks"]) == [0, 1] and ev["op"] == "allreduce" and ev["pg_ranks"] == [0, 1], ev
