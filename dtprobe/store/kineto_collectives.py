"""Turn a parsed Kineto trace's communication into ``collectives`` rows (op vocabulary, logical bytes, groups).

Sources, best first:
1. NCCL kernels carrying PyTorch 2.x args (``Collective name``, ``In msg nelems``, ``Out msg nelems``, ``dtype``,
   ``Group size``, ``Process Group Name/Description/Ranks``): device start/end, exact bytes and group.
2. Older NCCL traces: the kernel name (``ncclKernel_AllReduce_*``, ``ncclDevKernel_AllGather_*``) or the
   ``nccl:<op>`` annotation around its launch (``SendRecv`` kernels are only identified through it); bytes from
   the annotation's ``Input Dims`` x ``Input type``.
3. CPU (gloo) traces: ``gloo:<op>`` annotations (host timing), else ``c10d::<op>_`` CPU ops.
Runs in the workers that reduce each rank's file (``kineto_reduce``), which therefore import neither pandas nor
pyarrow; ``kineto_collective_frame`` turns the ranks' columns into the folder's ``collectives`` columns.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable

import msgspec
import numpy as np

from dtprobe.store.kineto_events import RankParse

DTYPE_BYTES: dict[str, int] = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "c10::half": 2,
    "bfloat16": 2, "c10::bfloat16": 2, "int": 4, "int32": 4, "long": 8, "long int": 8, "int64": 8,
    "short": 2, "short int": 2, "int16": 2, "byte": 1, "unsigned char": 1, "uint8": 1, "char": 1,
    "signed char": 1, "int8": 1, "bool": 1, "complexfloat": 8, "c10::complex<float>": 8,
    "complexdouble": 16, "c10::complex<double>": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}
"""Element size by PyTorch/NCCL dtype spelling (lower-cased): ``Float``, ``c10::BFloat16``, ``long int`` ..."""

_OP_PREFIXES: tuple[tuple[str, str], ...] = (
    ("allreduce", "allreduce"), ("allgather", "allgather"), ("reducescatter", "reduce_scatter"),
    ("alltoall", "alltoall"), ("broadcast", "broadcast"), ("barrier", "barrier"), ("gather", "gather"),
    ("scatter", "scatter"), ("reduce", "reduce"), ("send", "send"), ("recv", "recv"),
)
P2P_OPS = frozenset({"send", "recv"})


def normalize_op(raw: str | None) -> str | None:
    """Map any PyTorch/NCCL/gloo spelling to the store's op vocabulary; None when not a collective.

    ``allreduce_coalesced``, ``nccl:all_reduce``, ``gloo:all_reduce``, ``c10d::allreduce_``, ``AllReduce`` ->
    ``allreduce``; ``_allgather_base`` / ``all_gather_into_tensor_coalesced`` -> ``allgather``;
    ``_reduce_scatter_base`` -> ``reduce_scatter``; ``all_to_all`` / ``alltoall_base`` -> ``alltoall``;
    ``recv_any_source`` -> ``recv``. ``SendRecv`` (NCCL's kernel for both p2p and all-to-all), ``Generic``
    and ``wait`` give None.
    """
    if not raw:
        return None
    key = raw.lower()
    for prefix in ("nccl:", "gloo:", "c10d::", "rccl:"):
        if key.startswith(prefix):
            key = key[len(prefix):]
    key = key.replace("_", "")
    if key.startswith("sendrecv"):
        return None
    for prefix, op in _OP_PREFIXES:
        if key.startswith(prefix):
            return op
    return None


def op_from_kernel_name(name: str) -> str | None:
    """``ncclKernel_AllReduce_RING_LL_Sum_float(...)`` / ``ncclDevKernel_AllGather_RING_LL(...)`` -> op."""
    head = name.split("(", 1)[0]
    parts = head.split("_")
    return normalize_op(parts[1]) if len(parts) > 1 else None


def _elem_bytes(dtype: Any) -> int | None:
    return DTYPE_BYTES.get(str(dtype).strip().lower()) if dtype is not None else None


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _ranks_text(value: Any) -> str | None:
    """``"[0, 1]"`` or ``[0, 1]`` -> ``"0,1"``."""
    if isinstance(value, str):
        return _ranks_of_text(value)
    if isinstance(value, list):
        return _joined_ranks(value)
    return None


@functools.lru_cache(maxsize=4096)
def _ranks_of_text(value: str) -> str | None:
    """``_ranks_text`` of a string, once per distinct string: every collective of a group repeats its member
    list, so parsing it per row cost O(rows x group size) and dominated the reduction of large groups."""
    return _joined_ranks([p for p in value.strip("[] ").replace(" ", "").split(",") if p])


def _joined_ranks(items: list) -> str | None:
    out = [str(_as_int(i)) for i in items if _as_int(i) is not None]
    return ",".join(out) if out else None


def pg_label(name: Any, desc: Any) -> str | None:
    """Group name in the store's convention: ``world`` for the default group, else its description or name."""
    if desc == "default_pg" or (name == "0" and not desc):
        return "world"
    if isinstance(desc, str) and desc and desc != "undefined":
        return desc
    return str(name) if name is not None else None


def _raw_json(raw: Any) -> Any:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


def bytes_from_inputs(input_dims: Any, input_type: Any) -> tuple[int | None, str | None]:
    """Logical bytes of the tensors an annotation lists: sum(numel x element size); (None, None) if unknown."""
    dims, types = _raw_json(input_dims), _raw_json(input_type)
    if not isinstance(dims, list) or not isinstance(types, list):
        return None, None
    total, first_dtype = 0, None
    for shape, dtype in zip(dims, types):
        size = _elem_bytes(dtype)
        if not isinstance(shape, list) or size is None or not all(isinstance(d, int) for d in shape):
            continue
        total += math.prod(shape) * size
        first_dtype = first_dtype or str(dtype)
    return (total, first_dtype) if first_dtype else (None, None)


class _Annotations:
    """``nccl:*`` annotations by thread, for finding the one around a kernel's launch."""

    def __init__(self, rows: Iterable[tuple]) -> None:
        self.by_tid: dict[Any, list[tuple]] = {}
        for row in rows:
            if row[3].startswith("nccl:"):
                self.by_tid.setdefault(row[0], []).append(row)
        self.starts = {tid: [r[1] for r in sorted(rs, key=lambda r: r[1])] for tid, rs in self.by_tid.items()}
        for tid in self.by_tid:
            self.by_tid[tid].sort(key=lambda r: r[1])

    def around(self, tid: Any, t_ns: int) -> tuple | None:
        rows = self.by_tid.get(tid)
        if not rows:
            return None
        i = bisect.bisect_right(self.starts[tid], t_ns) - 1
        while i >= 0:
            row = rows[i]
            if row[1] <= t_ns <= row[2]:
                return row
            if t_ns - row[1] > 60_000_000_000:
                break
            i -= 1
        return None


def collective_rows(parsed: RankParse) -> list[dict[str, Any]]:
    """``collectives`` rows of one rank (without ``seq``: numbered across the rank by ``number_seq``)."""
    rows = _kernel_collectives(parsed)
    if not rows:
        rows = _host_collectives(parsed)
    return rows


def _default_group(parsed: RankParse) -> tuple[str | None, str | None, int | None]:
    """(pg, pg_ranks, pg_size) when the file names exactly one process group, else unknown."""
    configs = parsed.meta.pg_config
    if len(configs) == 1:
        cfg = configs[0]
        return (pg_label(cfg.get("pg_name"), cfg.get("pg_desc")), _ranks_text(cfg.get("ranks")),
                _as_int(cfg.get("pg_size")))
    return None, None, None


def _kernel_collectives(parsed: RankParse) -> list[dict[str, Any]]:
    k = parsed.kernels
    rank = parsed.meta.rank
    annotations = _Annotations(parsed.annotations)
    default_pg = _default_group(parsed)
    rows: list[dict[str, Any]] = []
    comm_codes = [c for c, kind in enumerate(parsed.name_kinds) if kind == "comm"]
    for i in np.flatnonzero(np.isin(k["name_code"], comm_codes)).tolist():
        name = parsed.names[k["name_code"][i]]
        launch_ns = int(k["launch_ns"][i])
        start_ns = int(k["start_ns"][i])
        row: dict[str, Any] = {
            "rank": rank, "enqueue_ns": launch_ns if launch_ns >= 0 else None, "start_ns": start_ns,
            "end_ns": start_ns + int(k["dur_ns"][i]), "step": int(k["step"][i]), "timing": "cuda_event",
        }
        args = parsed.comm_args.get(i)
        if args is not None:
            op = normalize_op(str(args.collective_name))
            size = _elem_bytes(args.dtype)
            nelems = _as_int(args.out_nelems if op == "allgather" else args.in_nelems)
            if op == "allgather" and nelems is None:
                nelems = _as_int(args.in_nelems)
                nelems = nelems * _as_int(args.group_size) if nelems and _as_int(args.group_size) else None
            row.update(
                op=op, dtype=str(args.dtype) if args.dtype is not None else None,
                num_bytes=0 if op == "barrier" else (nelems * size if nelems is not None and size else None),
                pg=pg_label(args.pg_name, args.pg_desc), pg_ranks=_ranks_text(args.pg_ranks),
                pg_size=_as_int(args.group_size), trace_seq=_as_int(args.seq))
        else:
            tid = parsed.launch_tid[i]
            ann = annotations.around(tid, launch_ns) if launch_ns >= 0 else None
            op = normalize_op(ann[3]) if ann else op_from_kernel_name(name)
            num_bytes, dtype = bytes_from_inputs(ann[4], ann[5]) if ann else (None, None)
            pg, pg_ranks, pg_size = default_pg
            if op == "allgather" and num_bytes is not None:
                num_bytes = num_bytes * pg_size if pg_size else None
            row.update(op=op, dtype=dtype, num_bytes=0 if op == "barrier" else num_bytes, pg=pg,
                       pg_ranks=pg_ranks, pg_size=pg_size)
        if row["op"] is None:
            continue
        rows.append(row)
    return rows


def _host_collectives(parsed: RankParse) -> list[dict[str, Any]]:
    source = [a for a in parsed.annotations if a[3].startswith("gloo:")] or parsed.c10d_ops
    pg, pg_ranks, pg_size = _default_group(parsed)
    steps = parsed.steps
    rows: list[dict[str, Any]] = []
    for tid, start, end, name, dims, types in sorted(source, key=lambda r: r[1]):
        op = normalize_op(name)
        if op is None:
            continue
        num_bytes, dtype = bytes_from_inputs(dims, types)
        if op == "allgather" and num_bytes is not None:
            num_bytes = num_bytes * pg_size if pg_size else None
        step = next((s for s, lo, hi in steps if lo <= start < hi), -1)
        rows.append({
            "rank": parsed.meta.rank, "op": op, "dtype": dtype, "num_bytes": 0 if op == "barrier" else num_bytes,
            "pg": pg, "pg_ranks": pg_ranks, "pg_size": pg_size, "enqueue_ns": start, "start_ns": None,
            "end_ns": end, "step": step, "timing": "host",
        })
    return rows


def number_seq(rows: list[dict[str, Any]]) -> str:
    """Set ``seq`` of every row; p2p ops get None. When every other row carries the trace's own per-group
    sequence number (``Seq`` arg, recent PyTorch), ``seq`` is that number and ``"trace"`` is returned; otherwise
    ``seq`` = 1-based order of each rank's collectives per group by enqueue time and ``"order"`` is returned
    (numbers that only say the order within this rank's profiler window, not which collective of the job)."""
    group_rows = [row for row in rows if row["op"] not in P2P_OPS]
    from_trace = bool(group_rows) and all(row.get("trace_seq") is not None for row in group_rows)
    counters: dict[tuple[Any, Any], int] = {}
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["enqueue_ns"] is None,
                                                      rows[i]["enqueue_ns"] or rows[i]["start_ns"] or 0))
    for i in order:
        row = rows[i]
        if row["op"] in P2P_OPS:
            row["seq"] = None
            continue
        if from_trace:
            row["seq"] = row["trace_seq"]
            continue
        key = (row["rank"], row.get("pg"))
        counters[key] = counters.get(key, 0) + 1
        row["seq"] = counters[key]
    return "trace" if from_trace else "order"


ROW_TYPES = {"rank": "int32", "pg": None, "pg_ranks": None, "pg_size": "int32", "op": None, "num_bytes": "int64",
             "dtype": None, "enqueue_ns": "int64", "start_ns": "int64", "end_ns": "int64", "step": "int64",
             "timing": None, "trace_seq": "int64"}
"""Columns of ``RankCollectives`` in order (None: a string, dictionary-encoded)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class RankCollectives:
    """One rank's ``collective_rows`` as columns: what a worker hands back instead of the dicts (a dict per
    collective costs about a kilobyte; these columns a few bytes, strings as codes into their distinct values)."""

    num_rows: int
    ints: dict[str, tuple[np.ndarray, np.ndarray]]
    """Integer column -> (int64 values, True where the value is known)."""
    strings: dict[str, tuple[np.ndarray, tuple[str, ...]]]
    """String column -> (int32 codes, -1 where null; the distinct values in order of first appearance)."""

    def __eq__(self, other: object) -> bool:
        """The same rows (columns compared element-wise)."""
        if not isinstance(other, RankCollectives):
            return NotImplemented
        return (self.num_rows == other.num_rows and self.ints.keys() == other.ints.keys()
                and self.strings.keys() == other.strings.keys()
                and all(np.array_equal(v, other.ints[c][0]) and np.array_equal(k, other.ints[c][1])
                        for c, (v, k) in self.ints.items())
                and all(np.array_equal(codes, other.strings[c][0]) and values == other.strings[c][1]
                        for c, (codes, values) in self.strings.items()))


def rank_collectives(rows: list[dict[str, Any]]) -> RankCollectives:
    """``collective_rows`` of one rank -> its ``RankCollectives``."""
    ints, strings = {}, {}
    for col, kind in ROW_TYPES.items():
        values = [row.get(col) for row in rows]
        if kind is None:
            distinct: dict[str, int] = {}
            codes = np.fromiter((-1 if v is None else distinct.setdefault(v, len(distinct)) for v in values),
                                dtype=np.int32, count=len(values))
            strings[col] = (codes, tuple(distinct))
        else:
            known = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
            ints[col] = (np.fromiter((0 if v is None else v for v in values), dtype=np.int64, count=len(values)),
                         known)
    return RankCollectives(num_rows=len(rows), ints=ints, strings=strings)
