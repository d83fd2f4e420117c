"""Parse ONE Kineto trace file into plain columns (GPU events, profiler steps, collective candidates); read by kineto.py.

The file is decoded a chunk of events at a time (``kineto_stream``: ``msgspec`` typed structs that name only the
fields dtprobe needs, so the many other event fields and args are skipped without allocating Python objects); each
chunk is reduced to numpy columns before the next is read, so memory holds one chunk of text and events plus the
columns kept (GPU events, launch times of host calls), not the file.

Event semantics follow Holistic Trace Analysis 0.5.0 (``hta/common/trace_parser.py``) so metrics agree with it:
- an event without ``dur`` or ``cat``, or with ``cat == "Trace"``, is dropped (metadata, flows, instants, spans);
- a GPU event is one whose ``args.stream`` converts with ``int()`` to a value other than -1 (kernels, memcpy,
  memset, stream syncs); ``"0x0"`` (ROCm runtime calls) does not convert and means CPU;
- a GPU event's step is the ``ProfilerStep#N`` that contains the host call with the same ``args.correlation``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from dtprobe.store.errors import TraceError
from dtprobe.store.kineto_stream import CHUNK_BYTES, Args, TraceEvents, TraceFile

COMM_KERNEL_RE = re.compile(r"^nccl.*Kernel|^ncclDevKernel|^rccl")
"""Communication kernels: HTA 0.5.0's ``^nccl.*Kernel`` (old ``ncclKernel_*`` and new ``ncclDevKernel_*``;
RCCL on ROCm keeps NCCL's kernel names) plus ``rccl*``."""
MEMORY_KERNEL_RE = re.compile(r"^Memcpy|^Memset|^dma")
"""Memory operations (HTA: ``(^Memcpy)|(^Memset)|(^dma)``)."""
_NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
"""HTA's ``is_compute_kernel`` negation: names matching it (stream syncs, ``*Memcpy*``) are kind ``other``."""

STEP_RE = re.compile(r"ProfilerStep\s*#\s*(\d+)")


def kernel_kind(name: str) -> str:
    """``comm`` | ``memory`` | ``compute`` | ``other`` for a GPU event name (HTA 0.5.0 ``get_kernel_type``)."""
    if COMM_KERNEL_RE.match(name):
        return "comm"
    if MEMORY_KERNEL_RE.match(name):
        return "memory"
    if _NOT_COMPUTE_RE.match(name):
        return "other"
    return "compute"


@dataclass(frozen=True, kw_only=True)
class RankMeta:
    """What a trace file says about its rank (Kineto's top-level ``distributedInfo`` and ``deviceProperties``)."""

    path: str
    """The trace file."""
    rank: int
    """``distributedInfo.rank``."""
    world_size: int | None
    """``distributedInfo.world_size`` (None when absent)."""
    backend: str | None
    """``distributedInfo.backend`` (``nccl``, ``gloo``, ...)."""
    pg_config: tuple[dict, ...]
    """``distributedInfo.pg_config``: one dict per process group (pg_name, pg_desc, pg_size, ranks)."""
    device_properties: tuple[dict, ...]
    """``deviceProperties``: one dict per visible GPU (name, totalGlobalMem, computeMajor, ...); empty on CPU."""
    base_time_ns: int
    """``baseTimeNanoseconds`` added to event ``ts`` to get Unix-epoch nanoseconds (0 when absent)."""
    num_events: int
    """Events in the file's ``traceEvents``."""
    rank_source: str = "distributedInfo.rank"
    """Where ``rank`` came from: ``distributedInfo.rank``, or ``single-process`` for a lone file without
    ``distributedInfo`` (a job run without torch.distributed: rank 0 of 1)."""


@dataclass(kw_only=True)
class RankParse:
    """Columns extracted from one file; assembled into tables by ``kineto.load_trace_dir``."""

    meta: RankMeta
    kernels: dict[str, Any]
    """name_code (int32: index into ``names``); stream, start_ns, dur_ns, correlation, launch_ns, step (int64
    arrays; -1 = none)."""
    names: list[str]
    """Distinct GPU event names, in order of first appearance (a trace has a few hundred)."""
    name_kinds: list[str]
    """``kernel_kind`` of each of ``names``."""
    launch_tid: list[Any]
    """Thread of each GPU event's launching host call (None when not found)."""
    steps: list[tuple[int, int, int]]
    """(step, start_ns, end_ns) per ``ProfilerStep#N``, merged over threads."""
    comm_args: dict[int, Args] = field(default_factory=dict)
    """GPU event index -> its args, for communication kernels that carry args."""
    annotations: list[tuple[Any, int, int, str, Any, Any]] = field(default_factory=list)
    """(tid, start_ns, end_ns, name, Input Dims raw, Input type raw) of ``nccl:*`` / ``gloo:*`` annotations."""
    c10d_ops: list[tuple[Any, int, int, str, Any, Any]] = field(default_factory=list)
    """The same for ``c10d::*`` CPU ops (collectives seen on the host when no ``gloo:*`` annotation exists)."""


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def read_rank_meta(path: Path, doc: TraceFile, *, single_file: bool = False, num_events: int) -> RankMeta:
    """Rank and job metadata of a file's top-level object (``num_events``: items of its ``traceEvents``);
    TraceError when the rank cannot be known (never a silent rank 0).

    A lone file without ``distributedInfo`` (``single_file``) is a single-process job: rank 0 of 1, recorded
    as ``rank_source="single-process"``. Among several files it is an error: its rank is unknowable.
    """
    info = doc.distributedInfo
    devices = doc.deviceProperties if isinstance(doc.deviceProperties, list) else []
    base = _int_or_none(doc.baseTimeNanoseconds) or 0
    if info is None and single_file:
        return RankMeta(path=str(path), rank=0, world_size=1, backend=None, pg_config=(),
                        device_properties=tuple(d for d in devices if isinstance(d, dict)), base_time_ns=base,
                        num_events=num_events, rank_source="single-process")
    if info is None:
        raise TraceError(
            f"{path}: the trace has no 'distributedInfo', so its rank is unknown among the other files of the "
            f"folder. Kineto writes "
            f"distributedInfo {{rank, world_size, backend}} only when torch.distributed is initialized before "
            f"the profiler starts: re-record that way, or add \"distributedInfo\": {{\"rank\": N, "
            f"\"world_size\": W}} to the file's top-level object.")
    if not isinstance(info, dict):
        raise TraceError(f"{path}: 'distributedInfo' is a {type(info).__name__}, expected an object with 'rank'.")
    rank = _int_or_none(info.get("rank"))
    if rank is None or rank < 0:
        found = "no 'rank'" if "rank" not in info else f"rank={info.get('rank')!r}"
        raise TraceError(
            f"{path}: distributedInfo has {found} (keys: {sorted(info)}), so the rank is unknown. Re-record with "
            f"torch.distributed initialized before the profiler starts, or add \"rank\": N to distributedInfo.")
    pg_config = info.get("pg_config") if isinstance(info.get("pg_config"), list) else []
    return RankMeta(
        path=str(path), rank=rank, world_size=_int_or_none(info.get("world_size")),
        backend=info.get("backend") if isinstance(info.get("backend"), str) else None,
        pg_config=tuple(p for p in pg_config if isinstance(p, dict)),
        device_properties=tuple(d for d in devices if isinstance(d, dict)),
        base_time_ns=base, num_events=num_events)


def _stream_id(value: Any) -> int:
    """HTA's ``normalize_gpu_stream_numbers``: ``int(value)``, -1 when absent or not convertible."""
    if value is None:
        return -1
    if type(value) is int:
        return value
    try:
        return int(value)
    except (ValueError, TypeError, OverflowError):
        return -1


def to_ns(values: list, base_ns: int) -> np.ndarray:
    """Trace microseconds (ints or floats) -> int64 nanoseconds + ``base_ns``, exact for integer microseconds."""
    arr = np.asarray(values)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64) * 1000 + base_ns
    if arr.dtype.kind != "f":
        bad = next((v for v in values if type(v) not in (int, float)), None)
        raise ValueError(f"non-numeric timestamp or duration {bad!r}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError("a timestamp or duration is NaN or infinite")
    whole = np.floor(arr)
    return whole.astype(np.int64) * 1000 + np.rint((arr - whole) * 1000).astype(np.int64) + base_ns


class _Columns:
    """Columns gathered from a file's events, a chunk at a time: each chunk's Python lists become numpy arrays
    (times in nanoseconds without the file's base time, known only once the whole file is read)."""

    def __init__(self) -> None:
        self.gpu: dict[str, list[np.ndarray]] = {k: [] for k in ("code", "stream", "ts", "dur", "corr")}
        self.num_gpu = 0
        self.launch: dict[str, list[np.ndarray]] = {k: [] for k in ("corr", "ts", "tid")}
        self.comm_args: dict[int, Args] = {}
        self.codes: dict[str, int] = {}
        self.names: list[str] = []
        self.name_kinds: list[str] = []
        self.tids: dict[Any, int] = {}
        self.step_events: list[tuple[int, Any, Any]] = []
        self.annotations: list[tuple[Any, Any, Any, str, Any, Any]] = []
        self.c10d_ops: list[tuple[Any, Any, Any, str, Any, Any]] = []

    def add(self, events: list) -> None:
        """Reduce one chunk of events."""
        g_code: list[int] = []
        g_stream: list[int] = []
        g_ts: list[Any] = []
        g_dur: list[Any] = []
        g_corr: list[int] = []
        l_corr: list[int] = []
        l_ts: list[Any] = []
        l_tid: list[int] = []
        codes, names, name_kinds, tids = self.codes, self.names, self.name_kinds, self.tids
        for ev in events:
            dur = ev.dur
            cat = ev.cat
            if dur is None or cat is None or cat == "Trace":
                continue
            ts = ev.ts
            if ts is None:
                continue
            args = ev.args
            if args is None:
                stream, corr = -1, None
            else:
                stream, corr = args.stream, args.correlation
                if stream is None:          # CPU ops: the common case, without a call
                    stream = -1
                elif type(stream) is not int:
                    stream = _stream_id(stream)
            name = ev.name
            if type(name) is not str:
                name = str(name)
            if stream != -1:
                code = codes.get(name)
                if code is None:     # each distinct name is kept (and classified) once
                    code = codes[name] = len(names)
                    names.append(name)
                    name_kinds.append(kernel_kind(name))
                if args is not None and args.collective_name is not None and name_kinds[code] == "comm":
                    args.input_dims = args.input_type = None   # views into the chunk's text would pin it
                    self.comm_args[self.num_gpu + len(g_code)] = args
                g_code.append(code)
                g_stream.append(stream)
                g_ts.append(ts)
                g_dur.append(dur)
                g_corr.append(corr if type(corr) is int else (_int_or_none(corr) if corr is not None else -1))
                continue
            if corr is not None:
                c = corr if type(corr) is int else _int_or_none(corr)
                if c is not None and c >= 0:
                    tid = ev.tid
                    tid_code = tids.get(tid)
                    if tid_code is None:
                        tid_code = tids[tid] = len(tids)
                    l_corr.append(c)
                    l_ts.append(ts)
                    l_tid.append(tid_code)
            first = name[:1]
            if first == "P" and name.startswith("ProfilerStep"):
                m = STEP_RE.match(name)
                if m:
                    self.step_events.append((int(m.group(1)), ts, dur))
            elif (first == "n" or first == "g") and cat == "user_annotation" and (
                    name.startswith("nccl:") or name.startswith("gloo:")):
                self.annotations.append((ev.tid, ts, dur, name, *_copied_inputs(args)))
            elif first == "c" and name.startswith("c10d::"):
                self.c10d_ops.append((ev.tid, ts, dur, name, *_copied_inputs(args)))
        if g_code:
            self.gpu["code"].append(np.asarray(g_code, dtype=np.int32))
            self.gpu["stream"].append(np.asarray(g_stream, dtype=np.int64))
            self.gpu["ts"].append(to_ns(g_ts, 0))
            self.gpu["dur"].append(to_ns(g_dur, 0))
            self.gpu["corr"].append(np.asarray([c if c is not None else -1 for c in g_corr], dtype=np.int64))
            self.num_gpu += len(g_code)
        if l_corr:
            self.launch["corr"].append(np.asarray(l_corr, dtype=np.int64))
            self.launch["ts"].append(to_ns(l_ts, 0))
            self.launch["tid"].append(np.asarray(l_tid, dtype=np.int64))

    def column(self, group: dict[str, list[np.ndarray]], key: str, dtype: type) -> np.ndarray:
        parts = group[key]
        return np.concatenate(parts) if parts else np.empty(0, dtype)


def parse_trace_file(path: str | Path, *, single_file: bool = False, chunk_bytes: int = CHUNK_BYTES) -> RankParse:
    """Decode one trace file ``chunk_bytes`` of text at a time and extract its GPU events, steps and collective
    candidates.

    ``single_file``: the file is the only one of its folder (see ``read_rank_meta``).
    """
    path = Path(path)
    stream = TraceEvents(path, chunk_bytes=chunk_bytes)
    cols = _Columns()
    try:
        for events in stream:
            cols.add(events)
            del events
        assert stream.top is not None
        meta = read_rank_meta(path, stream.top, single_file=single_file, num_events=stream.num_events)
        return _columns(meta, cols)
    except ValueError as exc:
        if isinstance(exc, TraceError):
            raise
        raise TraceError(f"{path}: {exc} in an event's 'ts'/'dur' (Kineto writes numbers in microseconds). "
                         f"Re-export the trace with torch.profiler.") from None


def _first_launches(cols: _Columns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each correlation id's earliest host call (the first in file order among equal times): sorted ids, their
    times (ns without base) and thread codes."""
    corr = cols.column(cols.launch, "corr", np.int64)
    ts = cols.column(cols.launch, "ts", np.int64)
    tid = cols.column(cols.launch, "tid", np.int64)
    order = np.lexsort((np.arange(len(corr)), ts, corr))
    corr, ts, tid = corr[order], ts[order], tid[order]
    first = np.ones(len(corr), dtype=bool)
    first[1:] = corr[1:] != corr[:-1]
    return corr[first], ts[first], tid[first]


def _columns(meta: RankMeta, cols: _Columns) -> RankParse:
    """Assemble the gathered columns: ns times, launch times and threads, steps."""
    base = meta.base_time_ns
    n = cols.num_gpu
    start_ns = cols.column(cols.gpu, "ts", np.int64) + base
    dur_ns = cols.column(cols.gpu, "dur", np.int64)
    corr_arr = cols.column(cols.gpu, "corr", np.int64)
    has_launch = np.zeros(n, dtype=bool)
    launch_ns = np.full(n, -1, dtype=np.int64)
    launch_tid: list[Any] = [None] * n
    l_corr, l_ts, l_tid = _first_launches(cols)
    if len(l_corr) and n:
        at = np.minimum(np.searchsorted(l_corr, corr_arr), len(l_corr) - 1)
        has_launch = (corr_arr >= 0) & (l_corr[at] == corr_arr)
        launch_ns[has_launch] = l_ts[at][has_launch] + base
        tid_values = list(cols.tids)
        launch_tid = [tid_values[t] if hit else None for t, hit in zip(l_tid[at].tolist(), has_launch.tolist())]

    steps = _merge_steps(cols.step_events, base)
    step = _assign_steps(launch_ns, has_launch, cols.step_events, base)

    return RankParse(
        meta=meta,
        kernels={"name_code": cols.column(cols.gpu, "code", np.int32),
                 "stream": cols.column(cols.gpu, "stream", np.int64), "start_ns": start_ns, "dur_ns": dur_ns,
                 "correlation": corr_arr, "launch_ns": launch_ns, "step": step},
        names=cols.names, name_kinds=cols.name_kinds, launch_tid=launch_tid, steps=steps,
        comm_args=cols.comm_args, annotations=_to_ns_rows(cols.annotations, base),
        c10d_ops=_to_ns_rows(cols.c10d_ops, base))


def _copied_inputs(args: Args | None) -> tuple[Any, Any]:
    """``Input Dims`` / ``Input type`` raw JSON, copied out of the file buffer (a Raw view would pin it)."""
    if args is None:
        return None, None
    return tuple(r.copy() if isinstance(r, msgspec.Raw) else None for r in (args.input_dims, args.input_type))


def _to_ns_rows(rows: list[tuple], base: int) -> list[tuple]:
    if not rows:
        return []
    start = to_ns([r[1] for r in rows], base)
    dur = to_ns([r[2] for r in rows], 0)
    return [(r[0], int(s), int(s + d), r[3], r[4], r[5]) for r, s, d in zip(rows, start, dur)]


def _merge_steps(step_events: list[tuple[int, Any, Any]], base: int) -> list[tuple[int, int, int]]:
    """One (step, start_ns, end_ns) per step number: ``ProfilerStep#N`` may appear on several threads."""
    if not step_events:
        return []
    start = to_ns([s[1] for s in step_events], base)
    dur = to_ns([s[2] for s in step_events], 0)
    merged: dict[int, tuple[int, int]] = {}
    for (num, _, _), s, d in zip(step_events, start, dur):
        lo, hi = merged.get(num, (int(s), int(s + d)))
        merged[num] = (min(lo, int(s)), max(hi, int(s + d)))
    return sorted((num, lo, hi) for num, (lo, hi) in merged.items())


def ceil_us(ns: np.ndarray) -> np.ndarray:
    """Round nanoseconds UP to whole microseconds (HTA rounds float ``ts`` with ``math.ceil``)."""
    return -((-ns) // 1000)


def floor_us(ns: np.ndarray) -> np.ndarray:
    """Round nanoseconds DOWN to whole microseconds (HTA floors ``ts + dur``)."""
    return ns // 1000


def _assign_steps(launch_ns: np.ndarray, has_launch: np.ndarray, step_events: list, base: int) -> np.ndarray:
    """HTA ``add_iteration``: the step whose [ts, ts + dur) holds the launch, in whole microseconds; the last
    matching ``ProfilerStep`` event in file order wins; -1 when none or the launch is unknown."""
    step = np.full(len(launch_ns), -1, dtype=np.int64)
    if not step_events or not len(launch_ns):
        return step
    launch_us = ceil_us(launch_ns)
    starts = to_ns([s[1] for s in step_events], base)
    ends = starts + to_ns([s[2] for s in step_events], 0)
    for (num, _, _), s, e in zip(step_events, ceil_us(starts), floor_us(ends)):
        step[has_launch & (launch_us >= s) & (launch_us < e)] = num
    return step
