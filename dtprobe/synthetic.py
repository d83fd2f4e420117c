"""Synthetic runs with known answers, for the tests, the dashboard tests and the benchmarks: hand-made,
deterministic timelines as schema-typed tables (``dp_tables``, ``cuda_dp_tables``, ``dp_pp_tables``,
``pipeline_tables``, ``lockstep_tables``), written as real run directories with the store's own writer (``write_run``,
``write_rows_run``, in the store's events layout: each group's members once, in ``groups``), or appended step by
step to a run that is still running (``SyntheticRun``).

``dp_tables`` / ``DataParallelTimeline`` model DDP: per step data -> fwd -> bwd (bucket all-reduces enqueued during
bwd, complete when the last member arrives + a transfer time) -> opt, with one optional straggler
(``dp_stall_tables``: one rank late in one step only). ``dp_pp_tables`` models dp x pp with one micro-batch: stage 0
sends activations to stage 1, stage 1 sends gradients back, then each stage all-reduces over its dp group. Times in
ms, converted to ns. No Streamlit, no torch.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pandas as pd

from dtprobe.collectors.comm_summaries import StepSummaries
from dtprobe.store.frames import frame_from_rows
from dtprobe.store.groups import GroupLayout

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def _ns(x_ms: float) -> int:
    return int(round(x_ms * MS))


class DataParallelTimeline:
    """The DDP timeline of ``dp_tables``, made step after step: ``next_rows(n)`` returns the rows (dicts with
    ``rank``) of the next ``n`` steps of ``steps``, ``collectives`` and ``devices``.

    Per rank and step: data 5 ms, fwd 30 ms, bwd compute 50 ms (each plus up to ``jitter_ms``), opt 10 ms; the
    straggler's ``phase`` (``data``, ``fwd``, else bwd) takes ``delay_ms`` longer from ``from_step`` on. Devices
    rows: one per rank and step, an NVML sample (``device_source="nvml"``) or a host sample (``"host"``).
    """

    def __init__(self, *, world: int = 4, straggler: int | None = None, delay_ms: float = 0.0, phase: str = "fwd",
                 num_buckets: int = 3, jitter_ms: float = 1.0, seed: int = 0, from_step: int = 0, pg: str = "dp",
                 xfer_ms: float = 3.0, throttle: bool = False, t0: int = T0, device_source: str = "nvml") -> None:
        self.world, self.straggler, self.delay_ms, self.phase = world, straggler, delay_ms, phase
        self.num_buckets, self.jitter_ms, self.from_step, self.pg = num_buckets, jitter_ms, from_step, pg
        self.xfer_ms, self.throttle, self.device_source = xfer_ms, throttle, device_source
        self.rng = random.Random(seed)
        self.t_ns = t0
        """Start of the next step."""
        self.next_step = 0
        self.seq = 0

    def next_rows(self, num_steps: int) -> dict[str, list[dict]]:
        world, rng = self.world, self.rng
        members = ",".join(str(r) for r in range(world))
        steps, coll, devices = [], [], []
        for step in range(self.next_step, self.next_step + num_steps):
            t = self.t_ns
            base = {}
            for r in range(world):
                data, fwd, comp = 5.0, 30.0, 50.0
                data += rng.uniform(0, self.jitter_ms)
                fwd += rng.uniform(0, self.jitter_ms)
                comp += rng.uniform(0, self.jitter_ms)
                if r == self.straggler and step >= self.from_step:
                    if self.phase == "data":
                        data += self.delay_ms
                    elif self.phase == "fwd":
                        fwd += self.delay_ms
                    else:
                        comp += self.delay_ms
                base[r] = (data, fwd, comp)
            enq = {r: [t + _ns(base[r][0] + base[r][1] + (k + 1) / self.num_buckets * base[r][2])
                       for k in range(self.num_buckets)] for r in range(world)}
            done = []
            prev_done = 0
            for k in range(self.num_buckets):
                last = max(enq[r][k] for r in range(world))
                d = max(last, prev_done) + _ns(self.xfer_ms)
                done.append(d)
                prev_done = d
            seq_base = self.seq
            ends = {}
            for r in range(world):
                data, fwd, comp = base[r]
                bwd_start = t + _ns(data + fwd)
                bwd_end = max(bwd_start + _ns(comp), done[-1])
                end = bwd_end + _ns(10.0)
                ends[r] = end
                steps.append({"rank": r, "step": step, "start_ns": t, "end_ns": end, "data_ns": _ns(data),
                              "fwd_ns": _ns(fwd), "bwd_ns": bwd_end - bwd_start, "opt_ns": _ns(10.0),
                              "loss": 5.0 - 0.1 * step, "tokens": 512, "lr": 1e-3, "restart": 0})
                for k in range(self.num_buckets):
                    coll.append({"rank": r, "pg": self.pg, "pg_ranks": members, "pg_size": world,
                                 "seq": seq_base + k + 1, "op": "allreduce", "num_bytes": 4 << 20,
                                 "dtype": "float32", "enqueue_ns": enq[r][k], "end_ns": done[k], "step": step,
                                 "timing": "host"})
                devices.append(self._device_row(r, step, t))
            self.seq += self.num_buckets
            self.t_ns = max(ends.values()) + _ns(1.0)
        self.next_step += num_steps
        return {"steps": steps, "collectives": coll, "devices": devices}

    def _device_row(self, rank: int, step: int, t: int) -> dict:
        if self.device_source == "host":
            return {"rank": rank, "host": f"node{rank // 8}", "time_ns": t + _ns(20), "source": "host", "gpu": -1,
                    "cpu_frac": 0.9 if rank == self.straggler else 0.6, "rss_bytes": (300 + step % 7) << 20,
                    "load1": 2.0, "step": step}
        return {"rank": rank, "host": "h", "time_ns": t + _ns(20), "source": "nvml", "gpu": rank,
                "throttle_reasons": (0x20 if self.throttle and rank == self.straggler else 0),
                "util_frac": 0.9, "step": step}


def dp_tables(*, world: int = 4, num_steps: int = 20, straggler: int | None = None, delay_ms: float = 0.0,
              phase: str = "fwd", num_buckets: int = 3, jitter_ms: float = 1.0, seed: int = 0,
              from_step: int = 0, pg: str = "dp", xfer_ms: float = 3.0, throttle: bool = False) -> dict:
    """``num_steps`` steps of ``DataParallelTimeline`` as schema-typed frames (``steps``, ``collectives``,
    ``devices``)."""
    rows = DataParallelTimeline(world=world, straggler=straggler, delay_ms=delay_ms, phase=phase,
                                num_buckets=num_buckets, jitter_ms=jitter_ms, seed=seed, from_step=from_step, pg=pg,
                                xfer_ms=xfer_ms, throttle=throttle).next_rows(num_steps)
    return {table: frame_from_rows(table, table_rows) for table, table_rows in rows.items()}


def dp_stall_tables(*, world: int = 4, num_steps: int = 30, rank: int = 2, step: int = 15, delay_ms: float = 400.0,
                    sampler_ms: float | None = 20.0, frozen: bool = False) -> dict:
    """``dp_tables`` with one stall: ``rank``'s forward takes ``delay_ms`` longer in ``step`` only (RANK_STALL);
    with ``sampler_ms``, host sampler rows of every rank at that interval instead of one device row per step,
    none of ``rank``'s during that step when ``frozen``."""
    timeline = DataParallelTimeline(world=world, jitter_ms=1.0, device_source="host")
    rows = timeline.next_rows(step)
    timeline.straggler, timeline.delay_ms, timeline.phase = rank, delay_ms, "fwd"
    stalled = timeline.next_rows(1)
    timeline.straggler = None
    later = timeline.next_rows(num_steps - step - 1)
    for table in rows:
        rows[table] += stalled[table] + later[table]
    if sampler_ms is not None:
        end = max(r["end_ns"] for r in rows["steps"])
        rows["devices"] = [row for r in range(world) for row in sampler_rows(r, T0, end, every_ms=sampler_ms)]
        if frozen:
            span = next(r for r in stalled["steps"] if r["rank"] == rank)
            rows["devices"] = [r for r in rows["devices"]
                               if not (r["rank"] == rank and span["start_ns"] < r["time_ns"] < span["end_ns"])]
    return {table: frame_from_rows(table, table_rows) for table, table_rows in rows.items()}


def dp_pp_tables(*, dp: int = 2, pp: int = 2, num_steps: int = 20, straggler: int | None = None,
                 delay_ms: float = 0.0, jitter_ms: float = 1.0, seed: int = 0, xfer_ms: float = 1.0) -> dict:
    """pp == 2 only: rank = d * pp + s; dp groups are ranks with the same stage."""
    assert pp == 2
    rng = random.Random(seed)
    steps, coll = [], []
    t = T0
    dp_seq = {s: 0 for s in range(pp)}
    p2p_seq = {}
    for step in range(num_steps):
        ends, ar_enq, ar_rows = {}, {}, {}
        for d in range(dp):
            r0, r1 = d * pp, d * pp + 1
            f0, b0, f1, b1 = (30 + rng.uniform(0, jitter_ms), 50 + rng.uniform(0, jitter_ms),
                              30 + rng.uniform(0, jitter_ms), 50 + rng.uniform(0, jitter_ms))
            if straggler == r0:
                f0 += delay_ms
            if straggler == r1:
                f1 += delay_ms
            data = 5.0
            send_act = t + _ns(data + f0)
            act_arr = send_act + _ns(xfer_ms)
            recv1_enq = t + _ns(data)
            s1_fwd_end = act_arr + _ns(f1)
            s1_bwd_end = s1_fwd_end + _ns(b1)
            grad_arr = s1_bwd_end + _ns(xfer_ms)
            s0_bwd_end = grad_arr + _ns(b0)

            def p2p(rank, peer, op, enq, end):
                key = (rank, peer)
                p2p_seq[key] = p2p_seq.get(key, 0) + 1
                coll.append({"rank": rank, "pg": "pp", "pg_ranks": f"{r0},{r1}", "pg_size": 2, "seq": p2p_seq[key],
                             "op": op, "num_bytes": 1 << 20, "dtype": "float32", "enqueue_ns": enq,
                             "end_ns": end, "step": step, "peer": peer, "timing": "host"})
            p2p(r0, r1, "send", send_act, act_arr)
            p2p(r1, r0, "recv", recv1_enq, act_arr)
            p2p(r1, r0, "send", s1_bwd_end, grad_arr)
            p2p(r0, r1, "recv", send_act + _ns(xfer_ms), grad_arr)
            ar_enq[r0], ar_enq[r1] = s0_bwd_end, grad_arr
            ar_rows[r0] = dict(data=data, fwd=f0, bwd=(s0_bwd_end - send_act) / MS)
            ar_rows[r1] = dict(data=data, fwd=(s1_fwd_end - recv1_enq) / MS, bwd=b1)
        for s in range(pp):
            group = [d * pp + s for d in range(dp)]
            dp_seq[s] += 1
            done = max(ar_enq[r] for r in group) + _ns(3.0)
            for r in group:
                coll.append({"rank": r, "pg": "dp", "pg_ranks": ",".join(map(str, group)), "pg_size": dp,
                             "seq": dp_seq[s], "op": "allreduce", "num_bytes": 4 << 20, "dtype": "float32",
                             "enqueue_ns": ar_enq[r], "end_ns": done, "step": step, "timing": "host"})
                end = done + _ns(10.0)
                ends[r] = end
                row = ar_rows[r]
                steps.append({"rank": r, "step": step, "start_ns": t, "end_ns": end, "data_ns": _ns(row["data"]),
                              "fwd_ns": _ns(row["fwd"]), "bwd_ns": _ns(row["bwd"]) + (done - ar_enq[r]),
                              "opt_ns": _ns(10.0), "loss": 4.0, "tokens": 256, "lr": 1e-3, "restart": 0})
        t = max(ends.values()) + _ns(1.0)
    return {"steps": frame_from_rows("steps", steps), "collectives": frame_from_rows("collectives", coll)}


def cuda_dp_tables(*, clock: str = "device", world: int = 4, num_steps: int = 20, straggler: int | None = None,
                   delay_ms: float = 0.0, num_buckets: int = 3, jitter_ms: float = 1.0, seed: int = 0,
                   pg: str = "dp", xfer_ms: float = 3.0) -> dict:
    """A DDP run on CUDA as its collector writes it, as schema-typed frames (``steps``, ``collectives``): the host
    runs ahead of its device, so a rank whose GPU is slow (``straggler``: its forward takes ``delay_ms`` longer on
    the device) still enqueues its all-reduces on time.

    Per rank and step, after the previous step's ``loss.item()`` synchronized host and device at ``t``: the host
    loads data (5 ms), launches fwd (2 ms) and bwd (3 ms; bucket k's all-reduce enqueued at (k+1)/B of it), then
    waits for the device; the device runs fwd 30 ms and bwd 50 ms (plus up to ``jitter_ms`` each) from the end
    of data loading, reaches bucket k's all-reduce at (k+1)/B of its bwd (``arrive_ns``), NCCL starts there and
    ends ``xfer_ms`` after the last member's arrival (one bucket after another), then opt 10 ms.

    ``clock="device"``: what the CUDA collectors write: ``arrive_ns``, NCCL's start/end (``timing="cuda_event"``),
    steps phased on the device (``steps.clock="device"``). ``clock="host"``: the same run as a host-only recorder
    sees it: host enqueues, completions as the host learns of them (``timing="host"``), host phases
    (``steps.clock="host"``), where the slow device only shows as the same wait for ``loss.item()`` on every
    rank."""
    if clock not in ("device", "host"):
        raise ValueError(f"cuda_dp_tables(clock={clock!r}): expected 'device' or 'host'")
    rng = random.Random(seed)
    members = ",".join(str(r) for r in range(world))
    steps, coll = [], []
    t, seq = T0, 0
    data_ms, opt_ms = 5.0, 10.0
    for step in range(num_steps):
        host_fwd = {r: 2.0 + rng.uniform(0, jitter_ms) for r in range(world)}
        host_bwd = {r: 3.0 + rng.uniform(0, jitter_ms) for r in range(world)}
        dev_fwd = {r: 30.0 + rng.uniform(0, jitter_ms) + (delay_ms if r == straggler else 0.0) for r in range(world)}
        dev_bwd = {r: 50.0 + rng.uniform(0, jitter_ms) for r in range(world)}
        bwd_start = {r: t + _ns(data_ms + dev_fwd[r]) for r in range(world)}
        enq = {r: [t + _ns(data_ms + host_fwd[r] + (k + 1) / num_buckets * host_bwd[r]) for k in range(num_buckets)]
               for r in range(world)}
        arrive = {r: [bwd_start[r] + _ns((k + 1) / num_buckets * dev_bwd[r]) for k in range(num_buckets)]
                  for r in range(world)}
        done, prev = [], 0
        for k in range(num_buckets):
            prev = max(max(arrive[r][k] for r in range(world)), prev) + _ns(xfer_ms)
            done.append(prev)
        end = done[-1] + _ns(opt_ms)        # every device ends its opt after the last all-reduce; the hosts sync
        for r in range(world):
            for k in range(num_buckets):
                row = {"rank": r, "pg": pg, "pg_ranks": members, "pg_size": world, "seq": seq + k + 1,
                       "op": "allreduce", "num_bytes": 4 << 20, "dtype": "float32", "enqueue_ns": enq[r][k],
                       "end_ns": done[k], "step": step, "timing": "host"}
                if clock == "device":
                    row.update(arrive_ns=arrive[r][k], start_ns=arrive[r][k], timing="cuda_event")
                coll.append(row)
            row = {"rank": r, "step": step, "start_ns": t, "end_ns": end, "data_ns": _ns(data_ms),
                   "loss": 5.0 - 0.1 * step, "tokens": 512, "lr": 1e-3, "restart": 0, "clock": clock}
            if clock == "device":
                row.update(fwd_ns=_ns(dev_fwd[r]), bwd_ns=done[-1] - bwd_start[r], opt_ns=_ns(opt_ms))
            else:
                launched = t + _ns(data_ms + host_fwd[r] + host_bwd[r])
                row.update(fwd_ns=_ns(host_fwd[r]), bwd_ns=_ns(host_bwd[r]), opt_ns=end - launched)
            steps.append(row)
        seq += num_buckets
        t = end + _ns(1.0)
    return {"steps": frame_from_rows("steps", steps), "collectives": frame_from_rows("collectives", coll)}


def _write_events(run_dir: Path, rows: dict[str, list[dict]], *, world_size: int) -> None:
    """Row dicts (each with its ``rank``; nulls as None) written with each rank's ``RankWriter`` in the events
    layout (``GroupLayout``: each group's members once, in ``groups``), nulls left out."""
    from dtprobe.store.writer import RankWriter

    writers = {r: RankWriter(run_dir, r) for r in range(world_size)}
    for table, table_rows in GroupLayout().split(rows).items():
        for row in table_rows:
            writers[int(row["rank"])].write(table, {k: v for k, v in row.items() if k != "rank" and v is not None})
    for w in writers.values():
        w.close()


def write_run(run_dir: Path, tables: dict[str, pd.DataFrame], *, world_size: int, config: dict | None = None,
              status: str = "finished") -> Path:
    """Write ``tables`` as a dtprobe run directory (events JSONL per rank, rank infos, run.json)."""
    from dtprobe.store.manifest import create_manifest, set_status, write_rank_info

    create_manifest(run_dir, run_id=run_dir.name, command=["synthetic"], config=config or {},
                    world_size=world_size)
    for r in range(world_size):
        write_rank_info(run_dir, r, host="h", node_rank=0, local_rank=r, device="cpu", pid=1000 + r,
                        clock_offset_ns=0)
    rows = {table: [{k: (None if pd.isna(v) else (v.item() if hasattr(v, "item") else v)) for k, v in row.items()}
                    for row in df.to_dict(orient="records")] for table, df in tables.items()}
    _write_events(run_dir, rows, world_size=world_size)
    if status != "running":
        set_status(run_dir, status)
    return run_dir


def pipeline_tables(*, schedule: str = "gpipe", pp: int = 4, microbatches: int = 4, f_ms: float = 10.0,
                    b_ms: float = 20.0, num_steps: int = 5, p2p_gap_ms: float = 0.0, clock: str | None = None) -> dict:
    """Pipeline rows replaying ``schedule_sim.simulate`` (so the measured bubble equals the ideal when
    ``p2p_gap_ms`` is 0) plus steps rows spanning each step's pipeline window; ``clock`` (``host`` / ``device``)
    is written in both tables' ``clock`` column (null when None, as in runs written before the column)."""
    from dtprobe.schedule_sim import simulate

    res = simulate(schedule, num_ranks=pp, num_microbatches=microbatches, cost_f=f_ms, cost_b=b_ms,
                   p2p_latency=p2p_gap_ms)
    pipe, steps = [], []
    t = T0
    for step in range(num_steps):
        for rank, stage, mb, action, a, b in res.records:
            pipe.append({"rank": rank, "stage": stage, "step": step, "microbatch": mb, "action": action,
                         "start_ns": t + _ns(a), "end_ns": t + _ns(b), "clock": clock})
        end = t + _ns(res.makespan)
        for rank in range(pp):
            steps.append({"rank": rank, "step": step, "start_ns": t, "end_ns": end + _ns(2.0), "tokens": 256,
                          "loss": 3.0, "clock": clock})
        t = end + _ns(5.0)
    return {"pipeline": frame_from_rows("pipeline", pipe), "steps": frame_from_rows("steps", steps)}


# ---------------------------------------------------------------------------------------------------- crashes / hangs
# Small lockstep runs for the crash, hang and mismatch verdicts: every rank runs steps of ``step_ms`` (data 10 ms,
# fwd 30, bwd 40, opt 20), issues one all-reduce of ``num_bytes`` at 60 ms into each step (bwd), and its sampler
# writes a devices row every 50 ms while it lives. Times in ms after ``t0``.

def lockstep_tables(*, world: int = 2, num_steps: int = 5, step_ms: float = 100.0, t0: int = T0, first_step: int = 0,
                    first_seq: int = 1, restart: int = 0, pg: str = "dp", ops: dict | None = None,
                    num_bytes: int = 4 << 20) -> dict[str, list[dict]]:
    """Row dicts (not frames: tests edit them) of ``steps``, ``collectives``, ``devices`` and ``lifecycle``
    (attach + close finished/exit). ``ops``: {(rank, step): op} to issue another op than ``allreduce``."""
    members = ",".join(map(str, range(world)))
    out = {"steps": [], "collectives": [], "devices": [], "lifecycle": []}
    for r in range(world):
        out["lifecycle"].append({"rank": r, "restart": restart, "time_ns": t0 - _ns(5), "event": "attach",
                                 "pid": 100 + r})
        for i in range(num_steps):
            step, start = first_step + i, t0 + _ns(i * step_ms)
            out["steps"].append({"rank": r, "step": step, "start_ns": start, "end_ns": start + _ns(step_ms),
                                 "data_ns": _ns(10), "fwd_ns": _ns(30), "bwd_ns": _ns(40), "opt_ns": _ns(20),
                                 "restart": restart, "tokens": 64})
            out["collectives"].append({"rank": r, "pg": pg, "pg_ranks": members, "pg_size": world,
                                       "seq": first_seq + i, "op": (ops or {}).get((r, step), "allreduce"),
                                       "num_bytes": num_bytes, "dtype": "float32",
                                       "enqueue_ns": start + _ns(60 + r), "start_ns": start + _ns(60 + r),
                                       "end_ns": start + _ns(70), "step": step, "timing": "host",
                                       "restart": restart})
        end = t0 + _ns(num_steps * step_ms)
        out["devices"] += sampler_rows(r, t0, end)
        out["lifecycle"].append({"rank": r, "restart": restart, "time_ns": end + _ns(5), "event": "close",
                                 "status": "finished", "reason": "exit", "pid": 100 + r})
    return out


def sampler_rows(rank: int, from_ns: int, to_ns: int, *, every_ms: float = 50.0) -> list[dict]:
    """A rank's host sampler rows every ``every_ms`` from ``from_ns`` to ``to_ns`` (its signs of life)."""
    rows, t = [], from_ns
    while t <= to_ns:
        rows.append({"rank": rank, "host": f"h{rank}", "time_ns": t, "source": "host", "cpu_frac": 0.5})
        t += _ns(every_ms)
    return rows


def frames(rows: dict[str, list[dict]]) -> dict[str, pd.DataFrame]:
    """Schema-typed frames of row dicts (every table of the schema present, empty when no rows)."""
    from dtprobe.store.schema import SCHEMAS

    return {t: frame_from_rows(t, rows.get(t, [])) for t in SCHEMAS}


def cut_rank(rows: dict[str, list[dict]], rank: int, after_ns: int, *, restart: int = 0) -> None:
    """Drop every row ``rank`` wrote after ``after_ns`` in ``restart`` (its telemetry stops there) and its close."""
    for table, cols in (("steps", "end_ns"), ("collectives", "enqueue_ns"), ("devices", "time_ns"),
                        ("lifecycle", "time_ns")):
        rows[table] = [x for x in rows[table] if not (x["rank"] == rank and x.get(cols) is not None
                                                      and x[cols] > after_ns and x.get("restart", 0) == restart)]
    rows["lifecycle"] = [x for x in rows["lifecycle"] if not (x["rank"] == rank and x["event"] == "close"
                                                              and x.get("restart", 0) == restart)]


def stall_rank(rows: dict[str, list[dict]], rank: int, at_ns: int, *, until_ns: int, restart: int = 0,
               close: tuple[str, str] | None = None) -> None:
    """``rank`` stops making progress at ``at_ns``: its step/collective rows after that are dropped; its sampler
    (alive) keeps writing until ``until_ns``; ``close``: (status, reason) of its probe's close at ``until_ns``
    (None: no close row)."""
    for table, col in (("steps", "end_ns"), ("collectives", "enqueue_ns")):
        rows[table] = [x for x in rows[table] if not (x["rank"] == rank and x[col] >= at_ns
                                                      and x.get("restart", 0) == restart)]
    rows["devices"] = [x for x in rows["devices"] if not (x["rank"] == rank and x["time_ns"] > at_ns)]
    rows["devices"] += sampler_rows(rank, at_ns + _ns(50), until_ns)
    rows["lifecycle"] = [x for x in rows["lifecycle"] if not (x["rank"] == rank and x["event"] == "close"
                                                              and x.get("restart", 0) == restart)]
    if close is not None:
        rows["lifecycle"].append({"rank": rank, "restart": restart, "time_ns": until_ns, "event": "close",
                                  "status": close[0], "reason": close[1], "pid": 100 + rank})


def pending_row(rank: int, *, step: int, seq: int, t_ns: int, world: int = 2, pg: str = "dp", op: str = "allreduce",
                restart: int = 0, peer: int | None = None, pg_ranks: str | None = None,
                num_bytes: int = 4 << 20) -> dict:
    """A ``pending`` row: ``rank`` entered this collective (or send/recv with ``peer``) at ``t_ns``."""
    row = {"rank": rank, "restart": restart, "pg": pg, "pg_ranks": pg_ranks or ",".join(map(str, range(world))),
           "pg_size": world if pg_ranks is None else len(pg_ranks.split(",")), "seq": seq, "op": op,
           "num_bytes": num_bytes, "dtype": "float32", "enqueue_ns": t_ns, "step": step, "timing": "host"}
    if peer is not None:
        row["peer"] = peer
    return row


def write_rows_run(run_dir: Path, rows: dict[str, list[dict]], *, world_size: int, status: str,
                   attempts: list[dict] | None = None, faults: list[dict] | None = None,
                   node_of: dict[int, int] | None = None) -> Path:
    """Write row dicts as a run directory (like ``write_run``), with run.json ``attempts`` and per-rank nodes."""
    import json

    from dtprobe.store.manifest import create_manifest, set_status, write_rank_info

    create_manifest(run_dir, run_id=run_dir.name, command=["synthetic"], config={}, world_size=world_size)
    for r in range(world_size):
        node = (node_of or {}).get(r, 0)
        write_rank_info(run_dir, r, host=f"node{node}", node_rank=node, local_rank=r, device="cpu", pid=100 + r,
                        clock_offset_ns=0)
    _write_events(run_dir, {**rows, "faults": (rows.get("faults") or []) + (faults or [])}, world_size=world_size)
    if status != "running":
        set_status(run_dir, status)
    if attempts is not None:
        path = run_dir / "run.json"
        doc = json.loads(path.read_text())
        doc["attempts"] = attempts
        path.write_text(json.dumps(doc))
    return run_dir


# ---------------------------------------------------------------------------------------------- runs being written


class SyntheticRun:
    """A data-parallel run directory being written with the store's writer (manifest, rank infos, then
    ``DataParallelTimeline`` rows with host device samples, clocks aligned): ``write_steps(n)`` appends n steps on
    every rank, ``finish()`` ends it. Its timestamps are recent, as a run being watched has them. The straggler's
    backward pass takes ``delay_ms`` longer, so it reaches the gradient all-reduces late."""

    def __init__(self, run_dir: str | os.PathLike, *, num_ranks: int, straggler_rank: int | None = None,
                 delay_ms: float = 30.0, num_buckets: int = 2, seed: int = 0, run_id: str | None = None) -> None:
        from dtprobe.store.manifest import create_manifest, write_rank_info
        from dtprobe.store.writer import RankWriter

        self.run_dir = Path(run_dir)
        self.num_ranks = num_ranks
        self.timeline = DataParallelTimeline(world=num_ranks, straggler=straggler_rank, delay_ms=delay_ms,
                                             phase="bwd", num_buckets=num_buckets, seed=seed, pg="world",
                                             t0=time.time_ns() - _ns(1000), device_source="host")
        create_manifest(self.run_dir, run_id=run_id or self.run_dir.name, command=["synthetic"],
                        config={"model": {"name": "tiny"}, "train": {"seq_len": 64},
                                "layout": {"dp": num_ranks, "tp": 1, "pp": 1, "zero": 0}},
                        world_size=num_ranks)
        for rank in range(num_ranks):
            write_rank_info(self.run_dir, rank, host=f"node{rank // 8}", node_rank=rank // 8, local_rank=rank % 8,
                            device="cpu", pid=10_000 + rank, clock_offset_ns=0)
        self.writers = [RankWriter(self.run_dir, rank, flush_interval_s=3600) for rank in range(num_ranks)]
        self._layout = GroupLayout()
        self._summaries = [StepSummaries(restart=None) for _ in range(num_ranks)]   # its rows have no restart

    @property
    def t_ns(self) -> int:
        """Start of the next step (Unix ns)."""
        return self.timeline.t_ns

    @property
    def next_step(self) -> int:
        return self.timeline.next_step

    def write_steps(self, num_steps: int) -> None:
        """Append ``num_steps`` more steps on every rank, with each rank's per-step summaries of its collectives
        (``comm_steps``, as its collector writes them), and flush them to disk."""
        for table, rows in self._layout.split(self.timeline.next_rows(num_steps)).items():
            for row in rows:
                rank, row = row["rank"], {k: v for k, v in row.items() if k != "rank"}
                self.writers[rank].write(table, row)
                if table == "collectives":
                    self._summaries[rank].add([row])
        for writer, summaries in zip(self.writers, self._summaries):
            for row in summaries.rest():
                writer.write("comm_steps", row)
            writer.flush()

    def close_writers(self) -> None:
        """Close the writers and leave the run ``running`` (its launcher was killed, say)."""
        for w in self.writers:
            w.close()

    def finish(self, status: str = "finished") -> None:
        """Close the writers and set the run's final status."""
        from dtprobe.store.manifest import set_status

        self.close_writers()
        set_status(self.run_dir, status)


def write_synthetic_run(run_dir: str | os.PathLike, *, num_ranks: int, num_steps: int,
                        straggler_rank: int | None = None, status: str = "finished", **kw) -> Path:
    """Write a whole ``SyntheticRun`` in one go (``status`` ``running`` leaves it running) and return its
    directory."""
    run = SyntheticRun(run_dir, num_ranks=num_ranks, straggler_rank=straggler_rank, **kw)
    run.write_steps(num_steps)
    if status == "running":
        run.close_writers()
    else:
        run.finish(status)
    return run.run_dir
