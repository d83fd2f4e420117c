"""A synthetic data-parallel run written with the store's own writer (manifest, rank infos, steps, collectives,
host device samples), optionally with one straggler rank; used by the dashboard tests and
benchmarks/dashboard_load.py. Pure (no streamlit)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dtprobe.store.manifest import create_manifest, set_status, write_rank_info
from dtprobe.store.writer import RankWriter

BUCKETS = 2
"""Gradient all-reduces per step (DDP buckets)."""
BUCKET_BYTES = 4 << 20


class SyntheticRun:
    """A run directory being written: ``write_steps(n)`` appends n steps on every rank, ``finish()`` ends it.

    Step timing per rank: data 5%, fwd 30%, bwd 40% of ``step_ms`` (the straggler's compute is ``late_frac`` of
    a step longer), then ``BUCKETS`` all-reduces entered at the end of backward that complete once the last
    rank arrives, then the optimizer. Clocks are perfectly aligned (offset 0).
    """

    def __init__(self, run_dir: str | os.PathLike, *, num_ranks: int, step_ms: float = 100.0,
                 straggler_rank: int | None = None, late_frac: float = 0.3, run_id: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.num_ranks = num_ranks
        self.step_ns = int(step_ms * 1e6)
        self.straggler_rank = straggler_rank
        self.late_ns = int(late_frac * self.step_ns)
        self.next_step = 0
        self.t_ns = time.time_ns() - 10 * self.step_ns
        create_manifest(self.run_dir, run_id=run_id or self.run_dir.name, command=["synthetic"],
                        config={"model": {"name": "tiny"}, "train": {"seq_len": 64},
                                "layout": {"dp": num_ranks, "tp": 1, "pp": 1, "zero": 0}},
                        world_size=num_ranks)
        for rank in range(num_ranks):
            write_rank_info(self.run_dir, rank, host=f"node{rank // 8}", node_rank=rank // 8, local_rank=rank % 8,
                            device="cpu", pid=10_000 + rank, clock_offset_ns=0)
        self.writers = [RankWriter(self.run_dir, rank, flush_interval_s=3600) for rank in range(num_ranks)]

    def write_steps(self, num_steps: int) -> None:
        """Append ``num_steps`` more steps on every rank and flush them to disk."""
        pg_ranks = ",".join(str(r) for r in range(self.num_ranks))
        for _ in range(num_steps):
            step, t0 = self.next_step, self.t_ns
            late = {r: (self.late_ns if r == self.straggler_rank else 0) for r in range(self.num_ranks)}
            arrive = {r: t0 + int(0.75 * self.step_ns) + late[r] + (r * 37_000 % 400_000)
                      for r in range(self.num_ranks)}
            last = max(arrive.values())
            comm_ns = int(0.05 * self.step_ns)
            end = last + BUCKETS * comm_ns + int(0.1 * self.step_ns)
            for rank, w in enumerate(self.writers):
                for bucket in range(BUCKETS):
                    enq = arrive[rank] if bucket == 0 else last + bucket * comm_ns
                    w.write("collectives", {
                        "pg": "world", "pg_ranks": pg_ranks, "pg_size": self.num_ranks,
                        "seq": step * BUCKETS + bucket + 1, "op": "allreduce", "num_bytes": BUCKET_BYTES,
                        "dtype": "float32", "enqueue_ns": enq, "start_ns": None,
                        "end_ns": last + (bucket + 1) * comm_ns, "step": step, "timing": "host"})
                w.write("steps", {
                    "step": step, "start_ns": t0, "end_ns": end, "data_ns": int(0.05 * self.step_ns),
                    "fwd_ns": int(0.3 * self.step_ns), "bwd_ns": int(0.4 * self.step_ns) + late[rank],
                    "opt_ns": int(0.1 * self.step_ns), "loss": 5.0 / (1 + 0.05 * step), "tokens": 8 * 64,
                    "lr": 1e-3, "restart": 0})
                w.write("devices", {"host": f"node{rank // 8}", "time_ns": t0 + self.step_ns // 2, "source": "host",
                                    "gpu": -1, "cpu_frac": 0.9 if late[rank] else 0.6,
                                    "rss_bytes": (300 + step % 7) << 20, "load1": 2.0, "step": step})
            self.t_ns = end + 1_000_000
            self.next_step += 1
        for w in self.writers:
            w.flush()

    def finish(self, status: str = "finished") -> None:
        """Close the writers and set the run's final status."""
        for w in self.writers:
            w.close()
        set_status(self.run_dir, status)


def write_synthetic_run(run_dir: str | os.PathLike, *, num_ranks: int, num_steps: int,
                        straggler_rank: int | None = None, status: str = "finished", **kw) -> Path:
    """Write a whole synthetic run in one go and return its directory."""
    run = SyntheticRun(run_dir, num_ranks=num_ranks, straggler_rank=straggler_rank, **kw)
    run.write_steps(num_steps)
    if status == "running":
        for w in run.writers:
            w.close()
    else:
        run.finish(status)
    return run.run_dir
