"""One GPU, real CUDA and NCCL: a 1-rank NCCL group under ``dtprobe.attach`` records its collectives with
NCCL timing and device arrival, steps on device events, and the GPU model (so MFU has a peak); CUDA events
resolve to the host clock; NCCL's ``WorkInfo`` times are what ``collectors.nccl`` assumes (steady-clock
``timedelta``). Run: ``python3 -m pytest -m gpu``."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(run_python, code: str, *args: str) -> dict:
    proc = run_python(textwrap.dedent(code), *args, timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_one_rank_nccl_run_records_device_arrival_nccl_times_device_steps_and_the_gpu_model(run_python, tmp_path):
    out = _run(run_python, """
        import json, sys, time
        import torch, torch.distributed as dist
        import dtprobe
        probe = dtprobe.attach(sys.argv[1], timeout_s=60)
        assert dist.get_backend() == "nccl"        # recorded, under the backend's own name
        spin = {}
        for step in range(5):
            with probe.step(step) as s:
                t = torch.ones(1 << 20, device="cuda")
                with s.phase("fwd"):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(); torch.cuda._sleep(50_000_000); end.record()
                    dist.all_reduce(t)      # the host issues it at once; the device reaches it after the spin
                s.record(loss=t.sum())
            spin[step] = start.elapsed_time(end) * 1e6
        time.sleep(1.0)                     # the watchdog reports the last completion
        probe.close()
        print(json.dumps({"spin_ns": spin, "name": torch.cuda.get_device_name(0)}))
        """, str(tmp_path / "run"))
    from dtprobe.analysis.peaks import peak_flops
    from dtprobe.store.resolve import open_source

    source = open_source(tmp_path / "run")
    rows = source.table("collectives")
    rows = rows[rows["op"] == "allreduce"].sort_values("step")
    assert len(rows) == 5 and set(rows["timing"]) == {"cuda_event"}
    for row in rows.itertuples():
        spin_ns = out["spin_ns"][str(row.step)]
        assert row.arrive_ns - row.enqueue_ns >= 0.5 * spin_ns        # arrival is the device's, not the launch
        assert row.arrive_ns <= row.start_ns + 50_000 and row.start_ns <= row.end_ns
    assert set(source.table("steps")["clock"]) == {"device"}
    assert source.info.device_name == out["name"]
    peak, why = peak_flops(source.info.device_name, "bfloat16")
    assert peak is not None, f"{why}: add this GPU to dtprobe.catalog.GPU_MODELS"


def test_cuda_events_resolve_inside_the_host_bracket(run_python):
    out = _run(run_python, """
        import json, time
        import torch
        from dtprobe.collectors.cuda_clock import DeviceClock
        clock = DeviceClock(device=0, refresh_s=0.5)
        results = []
        for _ in range(5):
            torch.cuda.synchronize()
            before = time.time_ns()
            torch.cuda._sleep(20_000_000)
            event = clock.mark()
            event.synchronize()
            after = time.time_ns()
            results.append([before, clock.to_unix_ns(event), after, clock.uncertainty_ns()])
            time.sleep(0.6)                  # the next resolution re-takes the reference
        print(json.dumps({"results": results, "references": clock.references_taken}))
        """)
    for before, resolved, after, half_width in out["results"]:
        assert before - half_width <= resolved <= after + half_width
    assert out["references"] >= 5


def test_nccl_workinfo_times_are_steady_clock_timedeltas_that_convert_into_the_call(run_python):
    out = _run(run_python, """
        import json, time, datetime
        import torch, torch.distributed as dist
        from dtprobe.collectors import nccl, torch_internals
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        pg = dist.group.WORLD
        infos = []
        torch_internals.enable_collectives_timing(pg)
        torch_internals.register_completion_hook(pg, infos.append)
        before = time.time_ns()
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        seq = torch_internals.collective_seq(pg)
        torch.cuda.synchronize()
        deadline = time.monotonic() + 10
        while not infos and time.monotonic() < deadline:
            time.sleep(0.05)
        after = time.time_ns()
        info = infos[0]
        offset = nccl.steady_unix_offset_ns()
        print(json.dumps({
            "types": [type(info.time_started).__name__, type(info.time_finished).__name__,
                      type(info.active_duration).__name__],
            "op": str(info.op_type), "seq": info.seq, "seq_read": seq,
            "started": nccl.work_time_unix_ns(info.time_started, steady_offset_ns=offset),
            "finished": nccl.work_time_unix_ns(info.time_finished, steady_offset_ns=offset),
            "before": before, "after": after}))
        dist.destroy_process_group()
        """)
    assert out["types"] == ["timedelta", "timedelta", "timedelta"]
    assert out["op"].endswith("ALLREDUCE") and out["seq"] == out["seq_read"]
    assert out["before"] - 1_000_000 <= out["started"] <= out["finished"] <= out["after"] + 1_000_000
