"""Synthetic data at cluster scale for ``benchmarks/scale.py``: a dtprobe run in a tp8 x dp layout written straight
in the run-store format (docs/run-store.md), and a set of Kineto traces of the same layout that dtprobe and HTA read.

    python benchmarks/scale_data.py run /tmp/scale/run64 --ranks 64 --steps 200
    python benchmarks/scale_data.py traces /tmp/scale/traces64 --ranks 64 --mb-per-rank 50

The run: every rank issues 100 collectives per step, 60 on its tp group (the 8 ranks of its node) and 40 on its dp
group (the ranks with its local rank on every node), as an FSDP x tensor-parallel step of 20 layers does: forward,
per layer, a dp all-gather of the layer's parameter shard, a tp all-gather and a tp reduce-scatter of the
activations; backward, per layer, a tp reduce-scatter and a dp reduce-scatter of the gradients. Host enqueue times
follow each rank's own compute (with jitter); a collective completes on every member when the last member is ready
(its enqueue, after the member's previous collective), plus its transfer time. One straggler rank spends
``delay_ms`` longer loading data every step, so it enqueues every collective of the step that much after its peers;
the analysis should name it. Rows are written with one ``%``-format per row from numpy columns (no dicts), by
``workers`` processes splitting the ranks, in chunks of steps; ``groups`` lines (a group's members, written once
per rank) first, as the store's writer does. Schema version: ``dtprobe.store.schema.SCHEMA_VERSION`` of the
dtprobe imported.

The trace set: one ``rankNNNNN.pt.trace.json`` per rank (``.json.gz`` with ``gzip``) with ``distributedInfo``
(rank, world size, its process groups), ProfilerStep annotations, CPU ops, ``cudaLaunchKernel`` runtime events with
their flow arrows, compute kernels and NCCL kernels carrying PyTorch 2.x collective args (``Collective name``,
``In msg nelems``, ``Process Group Ranks``, ...), in the tp8 x dp layout or a pure data-parallel one whose every
collective is on a group spanning every rank (``TRACE_LAYOUTS``), matched by order or, with ``seq``, by the
collectives' ``Seq`` arg; the model's depth is chosen so that a file holds about ``mb_per_rank`` MB. The header
is written with Python's default JSON spacing (HTA finds a file's rank with the regex ``"rank":\\s+(\\d+)``), the
events compactly.
"""

from __future__ import annotations

import argparse
import gzip as gzip_module
import json
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import orjson

TP = 8
"""Tensor-parallel degree (ranks per node)."""
NUM_LAYERS = 20
"""Layers of the synthetic model (per step: 3 collectives per layer forward, 2 backward)."""
MS = 1_000_000
"""Nanoseconds per millisecond."""
DEFAULT_DELAY_MS = 80.0
"""How much later than its peers the straggler enqueues every collective of a step (about 11% of the step)."""
STEP_CHUNK = 20
"""Steps generated and written at a time (bounds the writer's memory)."""


@dataclass(frozen=True)
class CollectiveOp:
    """One collective of the step's fixed sequence."""

    axis: str
    """``tp`` or ``dp``: the group it runs on."""
    op: str
    """Store op name."""
    num_bytes: int
    """Logical bytes (NCCL semantics)."""
    dtype: str
    """Element type (``bfloat16``, ``float32``)."""
    gap_ms: float
    """Host compute between the previous collective's enqueue (or the end of data loading) and this one's."""
    xfer_ms: float
    """Transfer time once every member is ready."""


ACT_BYTES = 4096 * 4096 * 2
"""One micro-batch's activations: 4,096 tokens x hidden 4,096 in bf16 (the tp all-gather / reduce-scatter)."""
SHARD_BYTES = 12 * 4096 * 4096 // TP * 2
"""One layer's parameters on a tp rank in bf16 (the dp all-gather of FSDP)."""


def step_ops() -> tuple[CollectiveOp, ...]:
    """The 100 collectives of one step in issue order: 60 on tp, 40 on dp."""
    fwd = (CollectiveOp("dp", "allgather", SHARD_BYTES, "bfloat16", 0.3, 2.5),
           CollectiveOp("tp", "allgather", ACT_BYTES, "bfloat16", 0.2, 0.35),
           CollectiveOp("tp", "reduce_scatter", ACT_BYTES, "bfloat16", 9.5, 0.35))
    bwd = (CollectiveOp("tp", "reduce_scatter", ACT_BYTES, "bfloat16", 19.0, 0.35),
           CollectiveOp("dp", "reduce_scatter", 2 * SHARD_BYTES, "float32", 0.5, 4.5))
    return fwd * NUM_LAYERS + bwd * NUM_LAYERS


OPS = step_ops()
NUM_FWD_OPS = 3 * NUM_LAYERS
"""Collectives issued in the forward pass (the rest are in the backward pass)."""
DATA_MS, OPT_MS, BWD_TAIL_MS = 20.0, 30.0, 0.5


@dataclass(frozen=True, kw_only=True)
class ScaleRunSpec:
    """What ``write_run`` writes."""

    world: int
    """Ranks: a multiple of 8, at least 16 (tp8 x dp>=2)."""
    steps: int
    """Steps written."""
    straggler_rank: int
    """The rank that is late at every collective of every step."""
    delay_ms: float = DEFAULT_DELAY_MS
    """How late it is (it loads data this much longer)."""
    seed: int = 0
    """Seed of the jitter."""

    def __post_init__(self) -> None:
        if self.world % TP or self.world < 2 * TP:
            raise ValueError(f"world={self.world}: a tp{TP} x dp layout needs a multiple of {TP}, at least "
                             f"{2 * TP}")
        if not 0 <= self.straggler_rank < self.world:
            raise ValueError(f"straggler_rank={self.straggler_rank} is not a rank of a world of {self.world}")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: write at least 1 step")

    @property
    def dp(self) -> int:
        return self.world // TP


def default_straggler(world: int) -> int:
    """The planted straggler: a rank in the middle of the world (not the leader, not the last)."""
    return world // 2 + 3


def group_members(world: int, tp: int = TP) -> dict[str, list[list[int]]]:
    """``{"tp": [[0..7], [8..15], ...], "dp": [[0, 8, ...], [1, 9, ...], ...]}``: rank = node * tp + local rank."""
    return {"tp": [list(range(n * tp, (n + 1) * tp)) for n in range(world // tp)],
            "dp": [list(range(t, world, tp)) for t in range(tp)]}


# ---------------------------------------------------------------------------------------------- the timeline

@dataclass
class Chunk:
    """``num_steps`` consecutive steps of every rank (arrays indexed [step, rank] or [step, rank, op])."""

    first_step: int
    enqueue_ns: np.ndarray
    end_ns: np.ndarray
    start_ns: np.ndarray
    step_end_ns: np.ndarray
    data_ns: np.ndarray
    fwd_ns: np.ndarray
    bwd_ns: np.ndarray
    next_t0_ns: int
    """Start of the step after the chunk."""


def make_chunk(spec: ScaleRunSpec, *, first_step: int, num_steps: int, t0_ns: int) -> Chunk:
    """The timeline of steps ``first_step ..`` starting at ``t0_ns`` (deterministic in seed and first step)."""
    rng = np.random.default_rng([spec.seed, first_step])
    world, num_ops = spec.world, len(OPS)
    gaps = np.array([op.gap_ms for op in OPS])
    xfer = np.array([op.xfer_ms for op in OPS])
    on_tp = np.array([op.axis == "tp" for op in OPS])
    data = DATA_MS + rng.uniform(0.0, 2.0, (num_steps, world))
    data[:, spec.straggler_rank] += spec.delay_ms
    # host times (ms from the step's start) of every enqueue: data loading, then each op's compute gap + jitter
    host = gaps + rng.uniform(0.0, 0.1, (num_steps, world, num_ops))
    enq = data[:, :, None] + np.cumsum(host, axis=2)
    done = np.empty_like(enq)
    prev = np.zeros((num_steps, world))
    dp = spec.dp
    for k in range(num_ops):
        ready = np.maximum(enq[:, :, k], prev).reshape(num_steps, dp, TP)
        last = ready.max(axis=2, keepdims=True) if on_tp[k] else ready.max(axis=1, keepdims=True)
        prev = done[:, :, k] = np.broadcast_to(last + xfer[k], ready.shape).reshape(num_steps, world)
    fwd_end = enq[:, :, NUM_FWD_OPS - 1]
    bwd_end = np.maximum(enq[:, :, -1] + BWD_TAIL_MS, done[:, :, -1])
    rank_end = bwd_end + OPT_MS
    step_len = rank_end.max(axis=1) + 1.0                          # the next step starts after the slowest rank
    starts = t0_ns + np.concatenate([[0], np.cumsum(np.round(step_len * MS).astype(np.int64))])
    start = starts[:-1, None]

    def as_ns(ms: np.ndarray) -> np.ndarray:
        return np.round(ms * MS).astype(np.int64)

    return Chunk(first_step=first_step, enqueue_ns=start[:, :, None] + as_ns(enq),
                 end_ns=start[:, :, None] + as_ns(done), start_ns=np.broadcast_to(start, (num_steps, world)),
                 step_end_ns=start + as_ns(rank_end), data_ns=as_ns(data), fwd_ns=as_ns(fwd_end - data),
                 bwd_ns=as_ns(bwd_end - fwd_end), next_t0_ns=int(starts[-1]))


def run_duration_ns(spec: ScaleRunSpec, num_steps: int) -> int:
    """Roughly how long ``num_steps`` steps last (to place a run so that it ends about now)."""
    step_ms = DATA_MS + spec.delay_ms + sum(op.gap_ms for op in OPS) + OPS[-1].xfer_ms + OPT_MS + 10.0
    return int(num_steps * step_ms * MS)


# ---------------------------------------------------------------------------------------------- row lines

def _collective_templates() -> list[str]:
    """Per op of the step: its ``collectives`` line with %d for (rank, seq, enqueue_ns, end_ns, step)."""
    out = []
    for op in OPS:
        out.append(('{"rank":%d,"pg":"' + op.axis + '","seq":%d,"op":"' + op.op + f'","num_bytes":{op.num_bytes},'
                    f'"dtype":"{op.dtype}","enqueue_ns":%d,"end_ns":%d,"step":%d,"timing":"host","restart":0}}\n'))
    return out


_STEP_LINE = ('{"rank":%d,"step":%d,"start_ns":%d,"end_ns":%d,"data_ns":%d,"fwd_ns":%d,"bwd_ns":%d,'
              f'"opt_ns":{int(OPT_MS * MS)},"loss":%.4f,"tokens":4096,"lr":0.0003,"restart":0,"clock":"host"}}\n')
_DEVICE_LINE = ('{"rank":%d,"host":"node%d","time_ns":%d,"source":"nvml","gpu":%d,"util_frac":0.93,'
                '"mem_util_frac":0.41,"mem_used_bytes":61203283968,"mem_total_bytes":85520809984,"power_w":%.1f,'
                '"power_limit_w":700.0,"temp_c":%.1f,"sm_clock_mhz":1980.0,"throttle_reasons":0,"step":%d}\n')


_COMM_STEP_LINE = ('{"rank":%d,"restart":0,"step":%d,%s"num_collectives":%d,"num_completed":%d,"num_bytes":%d,'
                   '"first_enqueue_ns":%d,"last_enqueue_ns":%d,"last_end_ns":%d,"comm_ns":%d,"longest_ns":%d}\n')


def _union_ns(enq: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per row (a rank-step): length of the union of the spans ``[enq, end]``, whose starts rise along axis 1, so one
    running maximum per row does (``dtprobe.intervals.union_length_by_group`` sorts first, and a writer of 1,024 ranks
    calls this 30,000 times)."""
    reach = np.maximum.accumulate(end, axis=1)
    before = np.concatenate([np.full((len(enq), 1), np.iinfo(np.int64).min), reach[:, :-1]], axis=1)
    return np.clip(end - np.maximum(enq, before), 0, None).sum(axis=1)


def _comm_step_lines(enq: np.ndarray, end: np.ndarray, rank: int, steps: list[int]) -> str:
    """The ``comm_steps`` lines of ``rank`` (``enq``/``end``: its collectives' times, steps x ops): per step one
    row per group and the all-groups row, what ``collectors.comm_summaries`` writes."""
    parts = []
    for axis in ("tp", "dp", None):
        cols = np.array([axis is None or op.axis == axis for op in OPS])
        e, d = enq[:, cols], np.maximum(end[:, cols], enq[:, cols])
        pg = '"all_groups":true,' if axis is None else f'"pg":"{axis}",'
        n, nbytes = int(cols.sum()), sum(op.num_bytes for op, c in zip(OPS, cols) if c)
        parts.append([_COMM_STEP_LINE % (rank, step, pg, n, n, nbytes, first, last, last_end, comm, longest)
                      for step, first, last, last_end, comm, longest in zip(
                          steps, e.min(axis=1).tolist(), e.max(axis=1).tolist(), d.max(axis=1).tolist(),
                          _union_ns(e, d).tolist(), (d - e).max(axis=1).tolist())])
    return "".join(line for rows in zip(*parts) for line in rows)


def _seq_offsets() -> tuple[np.ndarray, int, int]:
    """Per op: its 1-based number among its group's ops of the step; ops per step on tp and on dp."""
    counts = {"tp": 0, "dp": 0}
    within = []
    for op in OPS:
        counts[op.axis] += 1
        within.append(counts[op.axis])
    return np.array(within), counts["tp"], counts["dp"]


def _rank_lines(chunk: Chunk, rank: int, templates: list[str]) -> dict[str, str]:
    """The ``collectives``, ``comm_steps``, ``steps`` and ``devices`` lines of ``rank`` for the chunk's steps."""
    within, per_tp, per_dp = _seq_offsets()
    num_steps = chunk.enqueue_ns.shape[0]
    steps = np.arange(chunk.first_step, chunk.first_step + num_steps)
    per_step = np.where([op.axis == "tp" for op in OPS], per_tp, per_dp)
    seq = (steps[:, None] * per_step[None, :] + within[None, :]).tolist()
    enq, end = chunk.enqueue_ns[:, rank, :].tolist(), chunk.end_ns[:, rank, :].tolist()
    parts = []
    for i, step in enumerate(steps.tolist()):
        s, e, d = seq[i], enq[i], end[i]
        parts.extend([templates[k] % (rank, s[k], e[k], d[k], step) for k in range(len(OPS))])
    loss = 8.0 / (1.0 + 0.01 * steps)
    step_lines = "".join([_STEP_LINE % row for row in zip(
        [rank] * num_steps, steps.tolist(), chunk.start_ns[:, rank].tolist(), chunk.step_end_ns[:, rank].tolist(),
        chunk.data_ns[:, rank].tolist(), chunk.fwd_ns[:, rank].tolist(), chunk.bwd_ns[:, rank].tolist(),
        loss.tolist())])
    dev_lines = "".join([_DEVICE_LINE % (rank, rank // TP, t + 100 * MS, rank % TP, 640.0 + (step % 7),
                                         64.0 + (step % 5), step)
                         for t, step in zip(chunk.start_ns[:, rank].tolist(), steps.tolist())])
    comm_lines = _comm_step_lines(chunk.enqueue_ns[:, rank, :], chunk.end_ns[:, rank, :], rank, steps.tolist())
    return {"collectives": "".join(parts), "comm_steps": comm_lines, "steps": step_lines, "devices": dev_lines}


def _events_path(run_dir: Path, table: str, rank: int) -> Path:
    from dtprobe.store.schema import EVENTS_FILE

    return run_dir / EVENTS_FILE.format(table=table, rank=rank)


def _append_lines(run_dir: Path, rank: int, lines: dict[str, str]) -> None:
    for table, text in lines.items():
        with open(_events_path(run_dir, table, rank), "ab") as fh:
            fh.write(text.encode())


def _write_ranks(run_dir: Path, spec: ScaleRunSpec, ranks: list[int], first_step: int, num_steps: int,
                 t0_ns: int) -> int:
    """Write steps ``first_step ..`` of ``ranks`` in chunks; the start of the step after them."""
    templates = _collective_templates()
    t0, step, last = t0_ns, first_step, first_step + num_steps
    while step < last:
        n = min(STEP_CHUNK, last - step)
        chunk = make_chunk(spec, first_step=step, num_steps=n, t0_ns=t0)
        for rank in ranks:
            _append_lines(run_dir, rank, _rank_lines(chunk, rank, templates))
        t0, step = chunk.next_t0_ns, step + n
    return t0


def _worker(args: tuple) -> int:
    run_dir, spec_dict, ranks, first_step, num_steps, t0_ns = args
    return _write_ranks(Path(run_dir), ScaleRunSpec(**spec_dict), ranks, first_step, num_steps, t0_ns)


def sidecar_path(run_dir: Path) -> Path:
    """Where ``write_run`` notes the spec and the next step of a run (beside the run, not in it)."""
    return run_dir.parent / f"{run_dir.name}.scale.json"


def write_run(run_dir: str | os.PathLike, spec: ScaleRunSpec, *, workers: int = 2, status: str = "running",
              progress=None) -> Path:
    """Write ``spec`` as a dtprobe run at ``run_dir`` (which must not exist): run.json (status ``status``),
    ranks/*.json, events of ``groups``, ``collectives``, ``comm_steps``, ``steps`` and ``devices``; the run ends
    about now."""
    from dtprobe.store.manifest import create_manifest, set_status, write_rank_info

    run_dir = Path(run_dir)
    if run_dir.exists():
        raise FileExistsError(f"{run_dir} exists: write a scale run into a new directory")
    create_manifest(run_dir, run_id=run_dir.name, command=["benchmarks/scale_data.py"], world_size=spec.world,
                    nnodes=spec.dp, config={"layout": {"dp": spec.dp, "tp": TP, "pp": 1, "zero": 3},
                                            "train": {"seq_len": 4096}, "synthetic": asdict(spec)})
    members = group_members(spec.world)
    for rank in range(spec.world):
        write_rank_info(run_dir, rank, host=f"node{rank // TP}", node_rank=rank // TP, local_rank=rank % TP,
                        device=f"cuda:{rank % TP}", pid=10_000 + rank, clock_offset_ns=0,
                        device_name="NVIDIA H100 80GB HBM3")
    for table in ("groups", "collectives", "comm_steps", "steps", "devices"):
        _events_path(run_dir, table, 0).parent.mkdir(parents=True, exist_ok=True)
    for axis in ("tp", "dp"):
        for group in members[axis]:
            text = ",".join(map(str, group))
            for rank in group:
                line = orjson.dumps({"rank": rank, "pg": axis, "name": axis, "pg_ranks": text,
                                     "pg_size": len(group), "restart": 0}) + b"\n"
                with open(_events_path(run_dir, "groups", rank), "ab") as fh:
                    fh.write(line)
    t0 = time.time_ns() - run_duration_ns(spec, spec.steps)
    next_t0 = _write_steps(run_dir, spec, first_step=0, num_steps=spec.steps, t0_ns=t0, workers=workers,
                           progress=progress)
    sidecar_path(run_dir).write_text(json.dumps({"spec": asdict(spec), "next_step": spec.steps,
                                                 "next_t0_ns": next_t0}))
    if status != "running":
        set_status(run_dir, status)
    return run_dir


def _write_steps(run_dir: Path, spec: ScaleRunSpec, *, first_step: int, num_steps: int, t0_ns: int, workers: int,
                 progress=None) -> int:
    """Append steps to every rank's events (``workers`` processes, each a share of the ranks)."""
    ranks = list(range(spec.world))
    if workers <= 1:
        return _write_ranks(run_dir, spec, ranks, first_step, num_steps, t0_ns)
    # batches of ranks so that progress can be shown; each worker generates the timeline it needs itself
    batch = max(1, spec.world // (4 * workers))
    jobs = [(str(run_dir), asdict(spec), ranks[i:i + batch], first_step, num_steps, t0_ns)
            for i in range(0, spec.world, batch)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        results = []
        for i, t in enumerate(pool.imap_unordered(_worker, jobs)):
            results.append(t)
            if progress is not None:
                progress(min(spec.world, (i + 1) * batch), spec.world)
    assert len(set(results)) == 1, "every worker computes the same timeline"
    return results[0]


def append_step(run_dir: str | os.PathLike, *, at_ns: int | None = None) -> int:
    """Append the next step of every rank to a run made by ``write_run`` (what a live run writes meanwhile),
    starting at ``at_ns`` if later than where the run stopped; returns the step written."""
    run_dir = Path(run_dir)
    side = json.loads(sidecar_path(run_dir).read_text())
    spec = ScaleRunSpec(**side["spec"])
    step, t0 = int(side["next_step"]), int(side["next_t0_ns"])
    if at_ns is not None:
        t0 = max(t0, int(at_ns))
    next_t0 = _write_ranks(run_dir, spec, list(range(spec.world)), step, 1, t0)
    sidecar_path(run_dir).write_text(json.dumps({**side, "next_step": step + 1, "next_t0_ns": next_t0}))
    return step


def events_bytes(run_dir: str | os.PathLike) -> int:
    """Bytes of the run's events files."""
    return sum(p.stat().st_size for p in (Path(run_dir) / "events").rglob("*.jsonl"))


# ---------------------------------------------------------------------------------------------- Kineto traces

GEMM = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
        "kernel__5x_cublas")
ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl("
               "at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::"
               "operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, "
               "at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::"
               "operator()() const::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, "
               "at::detail::Array<char*, 2>)")
FLASH = ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t> >("
         "Flash_fwd_params)")
NCCL_KERNEL = {
    "allgather": "ncclKernel_AllGather_RING_LL_Sum_bfloat16(ncclDevComm*, unsigned long, ncclWork*)",
    "reduce_scatter": "ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16(ncclDevComm*, unsigned long, ncclWork*)"}
NCCL_COLLECTIVE_NAME = {"allgather": "_allgather_base", "reduce_scatter": "_reduce_scatter_base"}
COMPUTE_STREAM, COMM_STREAM = 7, 20
HOST_PID, HOST_TID = 4242, 4242

# A layer of the trace model: ("compute", cpu op, kernel, µs) or ("comm", axis, op, elements)
_TRACE_FWD = (("comm", "dp", "allgather", SHARD_BYTES // 2), ("comm", "tp", "allgather", ACT_BYTES // 2),
              ("compute", "aten::mm", GEMM, 420.0), ("compute", "aten::_flash_attention_forward", FLASH, 610.0),
              ("compute", "aten::mm", GEMM, 380.0), ("compute", "aten::gelu", ELEMENTWISE, 45.0),
              ("compute", "aten::mm", GEMM, 760.0), ("comm", "tp", "reduce_scatter", ACT_BYTES // 2))
_TRACE_BWD = (("compute", "aten::mm", GEMM, 820.0), ("compute", "aten::mm", GEMM, 790.0),
              ("compute", "aten::gelu_backward", ELEMENTWISE, 60.0), ("compute", "aten::mm", GEMM, 1500.0),
              ("comm", "tp", "reduce_scatter", ACT_BYTES // 2), ("comm", "dp", "reduce_scatter", SHARD_BYTES))
_XFER_US = {"tp": 350.0, "dp": 2500.0}


@dataclass(frozen=True, kw_only=True)
class TraceSetSpec:
    """What ``write_trace_set`` writes."""

    ranks: int
    """Files (ranks)."""
    mb_per_rank: float
    """About this many MB of JSON per file."""
    steps: int = 4
    """ProfilerSteps per file (a typical profiler window)."""
    straggler_rank: int | None = None
    """A rank whose compute kernels run 15% longer (None: none)."""
    gzip: bool = False
    """Write ``.json.gz`` instead of plain ``.json``."""
    seed: int = 0
    layout: str = "tp8xdp"
    """One of ``TRACE_LAYOUTS``."""
    seq: bool = False
    """Give each collective its group's sequence number (the ``Seq`` arg of recent PyTorch), which dtprobe then
    matches by; without it, collectives are matched by their order within each ProfilerStep."""

    def __post_init__(self) -> None:
        if self.layout not in TRACE_LAYOUTS:
            raise ValueError(f"TraceSetSpec.layout={self.layout!r}: expected one of {sorted(TRACE_LAYOUTS)}")


TRACE_LAYOUTS = {
    "tp8xdp": "tp groups of 8 ranks and dp groups across them (one tp group of every rank below 16 ranks)",
    "dp": "pure data parallel (FSDP): every collective on the default group, which spans every rank",
    "dp_unnamed": "as dp, with no process-group args or pg_config (older traces): every collective is taken as "
                  "world-wide"}
"""Layouts of a trace set: what its collectives' groups are."""


def trace_layout(world: int, layout: str = "tp8xdp") -> tuple[int, int]:
    """(tp, dp) of a trace set: for ``tp8xdp``, tp8 x dp when the world is a multiple of 8 of at least 16, else one
    tp group; for the pure data-parallel layouts, (1, world)."""
    if layout != "tp8xdp":
        return 1, world
    return (TP, world // TP) if world % TP == 0 and world >= 2 * TP else (world, 1)


def _trace_ops(num_layers: int, dp: int, tp: int) -> list[tuple]:
    def kept(op: tuple) -> bool:
        return not (op[0] == "comm" and ((op[1] == "dp" and dp == 1) or (op[1] == "tp" and tp == 1)))

    return [op for op in _TRACE_FWD if kept(op)] * num_layers + [op for op in _TRACE_BWD if kept(op)] * num_layers


def _simulate_trace_step(ops: list[tuple], world: int, tp: int, slow: np.ndarray, rng, t0_us: float) -> tuple:
    """Host launch times and kernel (start, end) of every op on every rank, arrays [op, rank] in µs."""
    n = len(ops)
    launch, start, end = np.empty((n, world)), np.empty((n, world)), np.empty((n, world))
    host = np.full(world, t0_us)
    compute = np.full(world, t0_us + 50.0)
    comm = np.full(world, t0_us)
    dp = world // tp
    for i, op in enumerate(ops):
        host = host + 12.0 + rng.uniform(0, 3.0, world)
        launch[i] = host
        if op[0] == "compute":
            s = np.maximum(compute, host + 5.0)
            e = s + op[3] * slow * (1.0 + rng.uniform(0, 0.02, world))
            compute = e
        else:
            ready = np.maximum.reduce([host + 5.0, comm, compute]).reshape(dp, tp)
            last = ready.max(axis=1, keepdims=True) if op[1] == "tp" else ready.max(axis=0, keepdims=True)
            s = np.broadcast_to(last, ready.shape).reshape(world)
            e = s + _XFER_US[op[1]]
            comm = e
            compute = np.maximum(compute, e) if not (op[1] == "dp" and op[2] == "reduce_scatter") else compute
        start[i], end[i] = s, e
        host = np.maximum(host, s - 2000.0)      # the host runs at most 2 ms ahead of the device (caching allocator)
    return launch, start, end


def _rank_step_events(ops: list[tuple], rank: int, step: int, launch, start, end, *, corr0: int,
                      members: dict[str, list[int]], tp: int, layout: str = "tp8xdp", seq: bool = False
                      ) -> list[dict]:
    """The events of one rank's step: ProfilerStep, then per op a CPU op, its launch, the flow and the kernel."""
    dp = len(members["tp"])
    node, local = rank // tp, rank % tp
    groups = {"tp": members["tp"][node], "dp": members["dp"][local] if dp > 1 else [rank]}
    names = {"tp": "1", "dp": "2"} if layout == "tp8xdp" else {"dp": "0"}
    descs = {"tp": "tp", "dp": "dp"} if layout == "tp8xdp" else {"dp": "default_pg"}
    per_step = {axis: sum(1 for op in ops if op[0] == "comm" and op[1] == axis) for axis in ("tp", "dp")}
    issued = {axis: step * n for axis, n in per_step.items()}      # the group's collectives before this one
    first, last = float(launch[0, rank]) - 100.0, float(max(end[-1, rank], launch[-1, rank])) + 200.0
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": HOST_PID,
               "tid": HOST_TID, "ts": round(first, 3), "dur": round(last - first, 3),
               "args": {"External id": corr0, "Record function id": 1}}]
    for i, op in enumerate(ops):
        corr = corr0 + 1 + i
        ts_cpu = round(float(launch[i, rank]) - 8.0, 3)
        ts_launch = round(float(launch[i, rank]), 3)
        ts_k, dur_k = round(float(start[i, rank]), 3), round(float(end[i, rank] - start[i, rank]), 3)
        if op[0] == "compute":
            events.append({"ph": "X", "cat": "cpu_op", "name": op[1], "pid": HOST_PID, "tid": HOST_TID,
                           "ts": ts_cpu, "dur": 14.0, "args": {"External id": corr, "Sequence number": corr}})
            kernel = {"ph": "X", "cat": "kernel", "name": op[2], "pid": 0, "tid": COMPUTE_STREAM, "ts": ts_k,
                      "dur": dur_k, "args": {"External id": corr, "queued": 0, "device": 0, "context": 1,
                                             "stream": COMPUTE_STREAM, "correlation": corr, "registers per thread": 168,
                                             "grid": [132, 1, 1], "block": [384, 1, 1]}}
        else:
            axis, name, nelems = op[1], op[2], op[3]
            group = groups[axis]
            ranks_text = "[" + ", ".join(map(str, group)) + "]"
            out = nelems * len(group) if name == "allgather" else nelems // len(group)
            comm_args = {"Collective name": NCCL_COLLECTIVE_NAME[name], "In msg nelems": nelems,
                         "Out msg nelems": out, "Group size": len(group), "dtype": "BFloat16",
                         "In split size": "[]", "Out split size": "[]"}
            if layout != "dp_unnamed":
                comm_args.update({"Process Group Name": names[axis], "Process Group Description": descs[axis],
                                  "Process Group Ranks": ranks_text})
            issued[axis] += 1
            if seq:
                comm_args["Seq"] = issued[axis]
            events.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": HOST_PID,
                           "tid": HOST_TID, "ts": ts_cpu, "dur": 20.0, "args": {"External id": corr, **comm_args}})
            kernel = {"ph": "X", "cat": "kernel", "name": NCCL_KERNEL[name], "pid": 0, "tid": COMM_STREAM,
                      "ts": ts_k, "dur": dur_k, "args": {"External id": corr, "queued": 0, "device": 0,
                                                         "context": 1, "stream": COMM_STREAM, "correlation": corr,
                                                         **comm_args}}
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": HOST_PID,
                       "tid": HOST_TID, "ts": ts_launch, "dur": 5.0,
                       "args": {"External id": corr, "cbid": 211, "correlation": corr}})
        events.append({"ph": "s", "id": corr, "pid": HOST_PID, "tid": HOST_TID, "ts": ts_launch, "cat": "ac2g",
                       "name": "ac2g"})
        events.append({"ph": "f", "id": corr, "pid": 0, "tid": kernel["tid"], "ts": ts_k, "cat": "ac2g",
                       "name": "ac2g", "bp": "e"})
        events.append(kernel)
    return events


def _trace_header(rank: int, world: int, members: dict[str, list[list[int]]], tp: int,
                  layout: str = "tp8xdp") -> dict:
    dp = world // tp
    pg_config = [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": world,
                  "ranks": list(range(world))}]
    if layout == "tp8xdp":
        pg_config.append({"pg_name": "1", "pg_desc": "tp", "backend_config": "cuda:nccl", "pg_size": tp,
                          "ranks": members["tp"][rank // tp]})
    if layout == "tp8xdp" and dp > 1:
        pg_config.append({"pg_name": "2", "pg_desc": "dp", "backend_config": "cuda:nccl", "pg_size": dp,
                          "ranks": members["dp"][rank % tp]})
    info = {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": len(pg_config),
            "pg_config": pg_config, "nccl_version": "2.21.5"}
    if layout == "dp_unnamed":
        del info["pg_count"], info["pg_config"]
    return {"schemaVersion": 1,
            "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85520809984,
                                  "computeMajor": 9, "computeMinor": 0, "numSms": 132}],
            "distributedInfo": info,
            "record_shapes": 1, "displayTimeUnit": "ms", "traceName": f"rank{rank:05d}.pt.trace.json"}


_TRACE_STATE: dict = {}
"""The simulated steps, shared with forked writer processes."""


def _write_trace_file(rank: int) -> int:
    st = _TRACE_STATE
    spec: TraceSetSpec = st["spec"]
    tp = st["tp"]
    suffix = ".pt.trace.json.gz" if spec.gzip else ".pt.trace.json"
    path = Path(st["out"]) / f"rank{rank:05d}{suffix}"
    head = json.dumps(_trace_header(rank, spec.ranks, st["members"], tp, spec.layout))[:-1]
    meta = [{"name": "process_name", "ph": "M", "ts": 0, "pid": HOST_PID, "tid": 0, "args": {"name": "python3"}},
            {"name": "process_name", "ph": "M", "ts": 0, "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
            {"name": "thread_name", "ph": "M", "ts": 0, "pid": 0, "tid": COMPUTE_STREAM,
             "args": {"name": f"stream {COMPUTE_STREAM}"}},
            {"name": "thread_name", "ph": "M", "ts": 0, "pid": 0, "tid": COMM_STREAM,
             "args": {"name": f"stream {COMM_STREAM}"}}]
    opener = gzip_module.open(path, "wb", compresslevel=1) if spec.gzip else open(path, "wb")
    raw = 0
    with opener as fh:
        def write(data: bytes) -> None:
            nonlocal raw
            fh.write(data)
            raw += len(data)

        write(head.encode() + b', "traceEvents": [')
        write(orjson.dumps(meta)[1:-1])
        for step, (launch, start, end) in enumerate(st["steps"]):
            events = _rank_step_events(st["ops"], rank, step, launch, start, end,
                                       corr0=1 + step * (len(st["ops"]) + 1), members=st["members"], tp=tp,
                                       layout=spec.layout, seq=spec.seq)
            write(b"," + orjson.dumps(events)[1:-1])
        write(b"]}")
    return raw


def write_trace_set(out_dir: str | os.PathLike, spec: TraceSetSpec, *, workers: int = 2,
                    progress=None) -> list[int]:
    """Write ``spec.ranks`` Kineto trace files of about ``spec.mb_per_rank`` MB of JSON each into ``out_dir``;
    the bytes of JSON of each file, by rank (before gzip)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tp, dp = trace_layout(spec.ranks, spec.layout)
    members = group_members(spec.ranks, tp)
    one_layer = _trace_ops(1, dp, tp)
    rng = np.random.default_rng(spec.seed)
    slow = np.ones(spec.ranks)
    if spec.straggler_rank is not None:
        slow[spec.straggler_rank] = 1.15
    # size one layer's events of one step on rank 0, then pick the depth that fills the files
    launch, start, end = _simulate_trace_step(one_layer, spec.ranks, tp, slow, rng, 0.0)
    layer_bytes = len(orjson.dumps(_rank_step_events(one_layer, 0, 0, launch, start, end, corr0=1,
                                                     members=members, tp=tp, layout=spec.layout, seq=spec.seq)))
    num_layers = max(1, round(spec.mb_per_rank * 1e6 / (spec.steps * layer_bytes)))
    ops = _trace_ops(num_layers, dp, tp)
    steps, t = [], time.time() * 1e6 - 600e6
    for _ in range(spec.steps):
        launch, start, end = _simulate_trace_step(ops, spec.ranks, tp, slow, rng, t)
        steps.append((launch, start, end))
        t = float(max(end.max(), launch.max())) + 5000.0
    _TRACE_STATE.update(spec=spec, tp=tp, members=members, ops=ops, steps=steps, out=str(out))
    raw = []
    try:
        if workers <= 1:
            for rank in range(spec.ranks):
                raw.append(_write_trace_file(rank))
                if progress is not None:
                    progress(rank + 1, spec.ranks)
        else:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                for size in pool.imap(_write_trace_file, range(spec.ranks)):
                    raw.append(size)
                    if progress is not None:
                        progress(len(raw), spec.ranks)
    finally:
        _TRACE_STATE.clear()
    return raw


def trace_files(trace_dir: str | os.PathLike) -> list[Path]:
    """The trace files of a set, sorted."""
    return sorted(p for p in Path(trace_dir).iterdir() if p.name.endswith((".pt.trace.json", ".pt.trace.json.gz")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="a dtprobe run in a tp8 x dp layout")
    run.add_argument("dir", type=Path, help="run directory to create")
    run.add_argument("--ranks", type=int, default=64, help="ranks (a multiple of 8, at least 16)")
    run.add_argument("--steps", type=int, default=200, help="steps")
    run.add_argument("--straggler", type=int, default=None, help="straggler rank (default: ranks // 2 + 3)")
    run.add_argument("--delay-ms", type=float, default=DEFAULT_DELAY_MS, help="the straggler's delay per step")
    run.add_argument("--workers", type=int, default=2, help="writer processes")
    tr = sub.add_parser("traces", help="a Kineto trace set in a tp8 x dp (or pure dp) layout")
    tr.add_argument("dir", type=Path, help="folder to write the trace files into")
    tr.add_argument("--ranks", type=int, default=64, help="trace files (ranks)")
    tr.add_argument("--mb-per-rank", type=float, default=50.0, help="MB of JSON per file")
    tr.add_argument("--steps", type=int, default=4, help="ProfilerSteps per file")
    tr.add_argument("--gzip", action="store_true", help="write .json.gz")
    tr.add_argument("--layout", choices=sorted(TRACE_LAYOUTS), default="tp8xdp",
                    help="; ".join(f"{k}: {v}" for k, v in TRACE_LAYOUTS.items()))
    tr.add_argument("--seq", action="store_true", help="give collectives their group's Seq arg")
    tr.add_argument("--workers", type=int, default=2, help="writer processes")
    args = ap.parse_args(argv)

    def progress(done: int, total: int) -> None:
        print(f"\r  {done}/{total} ranks", end="", flush=True)

    t = time.perf_counter()
    if args.what == "run":
        spec = ScaleRunSpec(world=args.ranks, steps=args.steps, delay_ms=args.delay_ms,
                            straggler_rank=default_straggler(args.ranks) if args.straggler is None else args.straggler)
        write_run(args.dir, spec, workers=args.workers, status="finished", progress=progress)
        print(f"\nwrote {spec.world} ranks x {spec.steps} steps ({spec.world * spec.steps * len(OPS):,} collective "
              f"rows, {events_bytes(args.dir) / 1e6:.0f} MB of events) in {time.perf_counter() - t:.1f} s; "
              f"straggler rank {spec.straggler_rank}")
    else:
        spec = TraceSetSpec(ranks=args.ranks, mb_per_rank=args.mb_per_rank, steps=args.steps, gzip=args.gzip,
                            layout=args.layout, seq=args.seq)
        raw = write_trace_set(args.dir, spec, workers=args.workers, progress=progress)
        size = sum(p.stat().st_size for p in trace_files(args.dir))
        print(f"\nwrote {spec.ranks} trace files, {sum(raw) / 1e6:.0f} MB of JSON ({size / 1e6:.0f} MB on disk), "
              f"in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
