"""The clock offset each rank measures against rank 0 at attach (``dtprobe.collectors.clock``): three gloo
processes on this machine, two of them told they share rank 0's clock."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_CLOCK_SCRIPT = """
import datetime, json, sys
import torch.distributed as dist
from dtprobe.collectors.clock import measure_clock_offset
rank, port, ids = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(ids),
                        timeout=datetime.timedelta(seconds=60))
out = [measure_clock_offset(rounds=4, clock_id=ids[rank])]
out.append(measure_clock_offset(rounds=4))            # the real id: every rank is on this machine
print(json.dumps(out))
dist.destroy_process_group()
from dtprobe.runtime.quick_exit import quick_exit
quick_exit(0)                                         # no torch teardown (seconds per process) after the work
"""


@pytest.mark.multiproc
@pytest.mark.exclusive
def test_clock_offset_is_zero_for_ranks_on_rank0s_machine_and_measured_elsewhere():
    """Ranks reading rank 0's clock (same kernel boot id) get offset 0 without a ping-pong; a rank with another
    clock id is measured (a positive round trip; on this one machine its offset is within the round trip)."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ids = "machineA,machineA,machineB"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _CLOCK_SCRIPT, str(r), str(port), ids], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    (r0, r0_real), (r1, r1_real), (r2, r2_real) = (json.loads(o[0]) for o in outs)
    assert r0 == [0, 0] and r1 == [0, 0]                     # rank 0 itself, and a rank on rank 0's machine
    offset, rtt = r2
    assert rtt > 0 and abs(offset) <= rtt                     # measured by ping-pong
    assert r0_real == r1_real == r2_real == [0, 0]
