"""Recording process-group backends (``dtprobe_gloo``, ``dtprobe_nccl``): one ``collectives`` row per collective.

A ``RecordingProcessGroup`` is a Python ``dist.ProcessGroup`` that forwards every call to a real process group
(gloo, or NCCL on CUDA) and records op, group, logical bytes, dtype, step and times. Being the process group
itself, it sees what a monkeypatch of ``torch.distributed`` misses: DDP's C++ reducer buckets, FSDP2
all-gather/reduce-scatter, DTensor collectives and pipeline send/recv.

Gloo collectives are recorded in C++ when the native recorder is built (``collectors/native_recorder.cpp``,
``native_module``; ``_NativeGlooGroup``): the row is taken at the issue, ``end_ns`` is stamped by a done-callback on
the work's future on the thread that completed it (no GIL), or when ``wait()`` returns for works without a future,
and the rows reach the recorder's drain thread (``collective_recorder``) in batches. The Python path records the
rest: point-to-point, NCCL, and gloo without the build (one stderr line says so).

The row of each collective goes to ``collective_recorder.RECORDER``, which writes it (and spills those in flight to
``pending``); the ``Work`` handed back for a gloo collective and how its completion is stamped are in
``recorded_work``.

On NCCL ``wait()`` does not block the host: NCCL rows are issued and timed on the device by
``collectors.nccl`` (arrival event, NCCL's own start/end, ``timing="cuda_event"``).
Read by ``collectors.attach`` (``register_backends``, the backend names) and torch's ``init_process_group`` /
``new_group`` (the registered backends).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import sys
import time
import weakref
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtprobe.collectors import native_recorder, nccl, torch_internals
from dtprobe.collectors.collective_recorder import RECORDER, CollectiveRecorder, GroupProgress, row_dict
from dtprobe.collectors.recorded_work import FutureDone, WaitHabit, wrap_work

GLOO_BACKEND = "dtprobe_gloo"
"""Name of the recording gloo backend: ``init_process_group(backend="dtprobe_gloo")``."""
NCCL_BACKEND = "dtprobe_nccl"
"""Name of the recording NCCL backend (CUDA tensors)."""
WORLD_GROUP = "world"
"""``pg`` value for the default group when nothing else names it."""


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _nbytes(t: torch.Tensor) -> int:
    return t.nbytes                      # numel * element size (of the view, not of its storage)


def _flat(tensors: Any) -> list[torch.Tensor]:
    """Tensors from a tensor, a list of tensors, or a list of lists of tensors."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    out: list[torch.Tensor] = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            out.append(t)
        else:
            out.extend(t)
    return out


def _sum_bytes(tensors: Any) -> tuple[int, str | None]:
    if type(tensors) is list and len(tensors) == 1 and isinstance(tensors[0], torch.Tensor):   # the usual case
        t = tensors[0]
        return t.nbytes, dtype_name(t.dtype)
    flat = _flat(tensors)
    return sum(_nbytes(t) for t in flat), (dtype_name(flat[0].dtype) if flat else None)


def _waits_now(args: tuple, kwargs: dict) -> bool:
    """True if the call's options (first extra argument, or ``opts=``) say ``asyncOp`` is False: torch's blocking
    API (``dist.all_reduce(t)`` and the like, ``async_op=False``) then waits on the work as soon as it is returned.
    C++ callers (DDP's reducer, functional collectives) and calls without options keep the default, True."""
    opts = args[0] if args else kwargs.get("opts")
    return getattr(opts, "asyncOp", True) is False


_SPLIT_DEVICE_TYPES_ARG = 5
"""Position of ``device_types`` in ``ProcessGroup.split_group(ranks, timeout, opts, group_name, group_desc,
device_types)``, counted from ``ranks``."""


def split_each_backend_once(inner: dist.ProcessGroup, ranks: Any, *args: Any, **kwargs: Any) -> Any:
    """``inner.split_group(ranks, ...)`` that splits each backend of ``inner`` once.

    torch 2.13's ``ProcessGroup::splitGroup`` splits once per device type, and a gloo group serves "cpu" and "cuda"
    with one ``ProcessGroupGloo``: that backend is split twice, both children rendezvous under the same store
    prefix (the group name), and the second is thrown away. The two rendezvous can cross, so that a rank's kept
    child is connected to its peer's discarded one: the first collective on the sub-group then waits for a recv
    that never comes, until gloo's timeout. So the split is asked for one device type per backend
    (``device_types``), and the other device types are mapped to the same child backend, as in the parent. A
    caller that names ``device_types`` gets exactly what it asked for."""
    if len(args) >= _SPLIT_DEVICE_TYPES_ARG or "device_types" in kwargs:
        return inner.split_group(ranks, *args, **kwargs)
    first: list[tuple[Any, torch.device]] = []          # (parent backend, the device type that splits it)
    shared: list[tuple[torch.device, torch.device]] = []  # (device type, the one whose child backend it shares)
    # cpu first: it must stay in the filter (torch checks that the filter holds the default backend's device type,
    # which for a gloo group that also serves cuda is cpu)
    for device in sorted(inner._device_types, key=lambda d: d.type != "cpu"):
        backend = inner._get_backend(device)
        owner = next((d for b, d in first if b is backend), None)
        if owner is None:
            first.append((backend, device))
        else:
            shared.append((device, owner))
    if not shared:
        return inner.split_group(ranks, *args, **kwargs)
    sub = inner.split_group(ranks, *args, device_types=[d for _, d in first], **kwargs)
    if sub is not None:
        for device, owner in shared:
            child = sub._get_backend(owner)
            backend_type = getattr(dist.ProcessGroup.BackendType, child.name().upper(),
                                   dist.ProcessGroup.BackendType.CUSTOM)
            sub._register_backend(device, backend_type, child)
    return sub


class RecordingProcessGroup(dist.ProcessGroup):
    """A process group that records each collective, then runs it on ``inner`` (a real ProcessGroup).

    ``pg`` in the rows is ``dtprobe_name`` when set (``probe.new_group(..., name=)``, mesh axes), ``"world"``
    for the default group, else ``"g<torch group name>"``. ``seq`` counts collectives on this group (1-based);
    send/recv are numbered apart, per (peer, direction): the k-th send to rank B has seq k, and so does B's
    k-th recv from this rank (same seq = same message). Never reorders or delays a collective: the row is
    built before the call and the call is forwarded as is, on the caller's thread.

    Made as a ``_NativeGlooGroup`` (collectives recorded in C++) when ``inner`` runs gloo on every device, the
    native recorder is built (``native_module``) and ``native`` is left on; else every call is recorded here.
    """

    def __new__(cls, inner: Any, rank: int, size: int, *, backend_name: str,
                recorder: CollectiveRecorder | None = None, device_timing: bool = False,
                native: bool = True) -> "RecordingProcessGroup":
        if (cls is RecordingProcessGroup and native and not device_timing and _runs_gloo(inner)
                and native_module() is not None):
            cls = _NativeGlooGroup
        return super().__new__(cls)

    def __init__(self, inner: dist.ProcessGroup, rank: int, size: int, *, backend_name: str,
                 recorder: CollectiveRecorder | None = None, device_timing: bool = False,
                 native: bool = True) -> None:
        super().__init__(rank, size)
        self._inner = inner
        self._rank = rank
        self._size = size
        self._backend_name = backend_name
        self._recorder = recorder or RECORDER
        self._device_timing = device_timing
        """True on NCCL: host ``wait()`` is not completion; rows come from the completion hook (or lack an end)."""
        self._group_name = ""
        self._group_desc = ""
        self.dtprobe_name: str | None = None
        """Recording name of this group (axis name); set by ``probe.new_group`` / ``probe.name_mesh``."""
        self._ranks_str: str | None = None
        self._fallback_name = ""
        self._key: str | None = None
        """``pg`` of this group's rows (``CollectiveRecorder.group_key``), for the name in ``_key_name``."""
        self._key_name: str | None = None
        self._seq = itertools.count(1)     # next() is atomic under the GIL: no lock on the hot path
        self._p2p_seq: dict[tuple[int, str], Any] = {}
        self._no_future_ops: set[str] = set()
        self._habits: dict[str, WaitHabit] = {}    # per op: how its callers wait (see WaitHabit)
        self._progress: GroupProgress | None = None
        """The recorder's progress of the group whose key the last blocking call had (``run_blocking``)."""
        self._nccl: Any = nccl.UntimedNccl(self._recorder) if device_timing else None
        """NCCL only: issues and times the recorded collectives (``collectors.nccl``)."""

    # ---- identity (DeviceMesh, FSDP2 and DTensor need the group name) ----
    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return self._backend_name

    def _get_backend_name(self) -> str:
        return self._backend_name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        self._inner._set_group_name(name)

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc
        self._inner._set_group_desc(desc)
        if self.dtprobe_name is None and desc.startswith("mesh_") and desc != "mesh_default":
            self.dtprobe_name = desc[len("mesh_"):]    # a DeviceMesh axis group (desc "mesh_<axis>"): its axis name

    @property
    def inner(self) -> dist.ProcessGroup:
        """The real process group every call is forwarded to."""
        return self._inner

    def _get_backend(self, device: Any) -> Any:
        return self._inner._get_backend(device)

    @property
    def _device_types(self) -> list:
        return self._inner._device_types

    @property
    def bound_device_id(self) -> Any:
        return self._inner.bound_device_id

    @bound_device_id.setter
    def bound_device_id(self, device: Any) -> None:
        self._inner.bound_device_id = device

    def set_timeout(self, timeout: Any) -> None:
        self._inner.set_timeout(timeout)

    def _get_sequence_number_for_group(self) -> int:
        return self._inner._get_sequence_number_for_group()

    def _set_sequence_number_for_group(self) -> None:
        self._inner._set_sequence_number_for_group()

    def abort(self) -> None:
        self._inner.abort()

    def shutdown(self) -> None:
        self._inner.shutdown()

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.monitored_barrier(*args, **kwargs)

    def get_group_store(self) -> Any:
        return self._inner.get_group_store()

    def split_group(self, ranks: Any, *args: Any, **kwargs: Any) -> Any:
        """The inner group's ``split_group`` (``dist.split_group``; a DeviceMesh of a group bound to a device),
        wrapped as a recording group like this one: the sub-group's collectives are recorded too. None for a rank
        outside ``ranks``."""
        sub = split_each_backend_once(self._inner, ranks, *args, **kwargs)
        if sub is None:
            return None
        wrapper = RecordingProcessGroup(sub, sub.rank(), sub.size(), backend_name=self._backend_name,
                                        recorder=self._recorder, device_timing=self._device_timing)
        wrapper._group_name = sub.group_name     # already set on the inner group by the split
        try:                                     # its members, known before torch registers it (if it does)
            parent = dist.get_process_group_ranks(self)
            wrapper._ranks_str = ",".join(str(parent[r]) for r in sorted(ranks))
            wrapper._fallback_name = f"g{sub.group_name}"
        except (RuntimeError, ValueError, KeyError, IndexError):
            pass                                 # resolved from torch's registry at its first collective
        if self._device_timing:
            nccl.time_rows(wrapper, self._recorder, device_timing=self._recorder.nccl_timing)
        return wrapper

    # ---- naming ----
    def _pg_key(self) -> str:
        """This group's key for the rows, resolved (and its ``groups`` row written) at the first recorded collective,
        and again if ``dtprobe_name`` changes; ``_issue`` reads the cached ``_key`` itself."""
        ranks = self._ranks_str
        if ranks is None:
            try:
                ranks = ",".join(str(r) for r in dist.get_process_group_ranks(self))
                is_world = dist.distributed_c10d._get_default_group() is self
            except (RuntimeError, ValueError, KeyError):   # not registered yet: no members known, nothing cached
                return self._recorder.group_key(self.dtprobe_name or f"g{self._group_name}", "", self._size)
            self._ranks_str = ranks
            self._fallback_name = WORLD_GROUP if is_world else f"g{self._group_name}"
        name = self.dtprobe_name
        self._key = self._recorder.group_key(name or self._fallback_name, ranks, self._size)
        self._key_name = name
        return self._key

    # ---- recording core ----
    def _issue(self, op: str, num_bytes: int, dtype: str | None, call: Callable[..., dist.Work], args: tuple,
               kwargs: dict[str, Any], peer: int | None = None, waits_now: bool = False) -> dist.Work:
        """Record ``call(*args, **kwargs)`` (the inner group's method and the caller's arguments, forwarded as
        given) as collective ``op``, or as a send/recv to ``peer``."""
        recorder = self._recorder            # callers checked recorder.active
        pg = self._key
        if pg is None or self.dtprobe_name is not self._key_name:
            pg = self._pg_key()
        if peer is None:
            seq = next(self._seq)
        else:
            counter = self._p2p_seq.get((peer, op))
            if counter is None:
                counter = self._p2p_seq.setdefault((peer, op), itertools.count(1))
            seq = next(counter)
        row: dict[str, Any] | tuple = (pg, seq, op, int(num_bytes), dtype, recorder._step, "host", time.time_ns(),
                                       recorder._restart)        # ROW_COLUMNS but end_ns
        if peer is None and not self._device_timing:     # a gloo collective: the row stays a tuple
            if waits_now and recorder._timing != "enqueue":
                # torch's blocking API (async_op=False) waits on the work as soon as it is returned: wait here, on
                # the caller's thread, stamp the end and hand back the completed backend Work (its wait() returns
                # at once). No Python Work, no done-callback on the gloo thread.
                progress = self._progress
                if progress is None or progress.pg != pg:
                    progress = self._progress = recorder.group_progress(pg)
                return recorder.run_blocking(row, progress, call, args, kwargs)
        else:                                            # p2p and NCCL rows are dicts, with ``peer`` for p2p
            row = row_dict(row)
            if peer is not None:
                row["peer"] = peer
            if self._device_timing:            # NCCL: timed on the device by collectors/nccl.py
                return self._nccl.issue(row, functools.partial(call, *args, **kwargs), peer=peer)
        work = call(*args, **kwargs)
        if work is None or recorder._timing == "enqueue":
            recorder.emit(row)
            return work
        habit = self._habits.get(op)
        if habit is not None and habit.prompt >= WaitHabit.PROMPT_WAITS and not habit.future_taken:
            # Its callers wait before completion: the wrapper's wait(), or its future's, stamps end_ns on the
            # caller's thread.
            return wrap_work(work, row, recorder, habit)
        if op in self._no_future_ops:
            return wrap_work(work, row, recorder)
        if habit is None:
            habit = self._habits[op] = WaitHabit()
        try:
            future = work.get_future()
        except RuntimeError:               # gloo p2p and reduce-scatter works have no future
            self._no_future_ops.add(op)
            return wrap_work(work, row, recorder)
        if habit.future_taken or not habit.issued:
            habit.issued = True
            # The caller keeps the backend's own Work: a Python Work handed to C++ (DDP's reducer) costs GIL
            # round trips on every getFuture and destruction. The callback runs where the backend completes the
            # work (a gloo worker thread), so end_ns is the completion time.
            recorder.on_done(future, FutureDone(recorder, recorder.track(row), row))
            return work
        return wrap_work(work, row, recorder, habit, future)

    def _global_peer(self, group_peer: int) -> int:
        try:
            return dist.get_global_rank(self, group_peer)
        except (RuntimeError, ValueError, KeyError):
            return group_peer

    # ---- collectives (Python API names and C++ trampoline names) ----
    def allreduce(self, tensors: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.allreduce(tensors, *args, **kwargs)
        n, dt = _sum_bytes(tensors)
        return self._issue("allreduce", n, dt, self._inner.allreduce, (tensors, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def allreduce_coalesced(self, tensors: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.allreduce_coalesced(tensors, *args, **kwargs)
        n, dt = _sum_bytes(tensors)
        return self._issue("allreduce", n, dt,
                           self._inner.allreduce_coalesced, (tensors, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def broadcast(self, tensors: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.broadcast(tensors, *args, **kwargs)
        n, dt = _sum_bytes(tensors)
        return self._issue("broadcast", n, dt, self._inner.broadcast, (tensors, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def reduce(self, tensors: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.reduce(tensors, *args, **kwargs)
        n, dt = _sum_bytes(tensors)
        return self._issue("reduce", n, dt, self._inner.reduce, (tensors, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def allgather(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.allgather(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(outputs)
        return self._issue("allgather", n, dt, self._inner.allgather, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def allgather_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.allgather_coalesced(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(outputs)
        return self._issue("allgather", n, dt,
                           self._inner.allgather_coalesced, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner._allgather_base(output, input, *args, **kwargs)
        return self._issue("allgather", _nbytes(output), dtype_name(output.dtype),
                           self._inner._allgather_base, (output, input, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner._allgather_base(output, input, *args, **kwargs)
        return self._issue("allgather", _nbytes(output), dtype_name(output.dtype),
                           self._inner._allgather_base, (output, input, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.allgather_into_tensor_coalesced(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(outputs)
        return self._issue("allgather", n, dt,
                           self._inner.allgather_into_tensor_coalesced, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.reduce_scatter(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(inputs)
        return self._issue("reduce_scatter", n, dt,
                           self._inner.reduce_scatter, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner._reduce_scatter_base(output, input, *args, **kwargs)
        return self._issue("reduce_scatter", _nbytes(input), dtype_name(input.dtype),
                           self._inner._reduce_scatter_base, (output, input, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner._reduce_scatter_base(output, input, *args, **kwargs)
        return self._issue("reduce_scatter", _nbytes(input), dtype_name(input.dtype),
                           self._inner._reduce_scatter_base, (output, input, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.reduce_scatter_tensor_coalesced(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(inputs)
        return self._issue("reduce_scatter", n, dt,
                           self._inner.reduce_scatter_tensor_coalesced, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.alltoall_base(output, input, *args, **kwargs)
        return self._issue("alltoall", _nbytes(input), dtype_name(input.dtype),
                           self._inner.alltoall_base, (output, input, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.alltoall(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(inputs)
        return self._issue("alltoall", n, dt, self._inner.alltoall, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def gather(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.gather(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(inputs)    # logical: every member's input, gathered at the root
        return self._issue("gather", n * self._size, dt,
                           self._inner.gather, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def scatter(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.scatter(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(outputs)   # logical: every member's output, scattered from the root
        return self._issue("scatter", n * self._size, dt,
                           self._inner.scatter, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def barrier(self, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.barrier(*args, **kwargs)
        return self._issue("barrier", 0, None, self._inner.barrier, args, kwargs,
                           waits_now=_waits_now(args, kwargs))

    def send(self, tensors: Any, dst: int, tag: int = 0) -> dist.Work:
        if not self._recorder.active:
            return self._inner.send(tensors, dst, tag)
        n, dt = _sum_bytes(tensors)
        return self._issue("send", n, dt, self._inner.send, (tensors, dst, tag), {}, peer=self._global_peer(dst))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> dist.Work:
        if not self._recorder.active:
            return self._inner.recv(tensors, src, tag)
        n, dt = _sum_bytes(tensors)
        return self._issue("recv", n, dt, self._inner.recv, (tensors, src, tag), {}, peer=self._global_peer(src))

    def recv_anysource(self, tensors: Any, tag: int = 0) -> dist.Work:
        if not self._recorder.active:
            return self._inner.recv_anysource(tensors, tag)
        n, dt = _sum_bytes(tensors)
        return self._issue("recv", n, dt, self._inner.recv_anysource, (tensors, tag), {}, peer=-1)

    # ---- NCCL timing and coalescing (collectors/nccl.py) ----
    def enable_completion_timing(self, **kwargs: Any) -> bool:
        """Time collectives on the device through the inner NCCL group's timing and completion hook
        (``nccl.enable_completion_timing`` keywords: ``clock``, ``steady_offset_ns``); False if unavailable."""
        matcher = nccl.enable_completion_timing(self._inner, self._recorder, **kwargs)
        if matcher is not None:
            self._nccl = matcher
        return matcher is not None

    def set_nccl_timing(self, timing: Any) -> None:
        """Use ``timing`` (an object with ``issue``/``start_coalescing``/``end_coalescing``) for NCCL rows."""
        self._nccl = timing

    def _start_coalescing(self, device: Any) -> None:
        if self._nccl is not None:
            self._nccl.start_coalescing()
        self._inner._start_coalescing(device)

    def _end_coalescing(self, device: Any) -> Any:
        try:
            return self._inner._end_coalescing(device)
        finally:
            if self._nccl is not None:
                self._nccl.end_coalescing()


def _runs_gloo(inner: Any) -> bool:
    """True if ``inner`` is a process group whose every device runs a gloo backend."""
    gloo = getattr(dist, "ProcessGroupGloo", None)
    if gloo is None or not isinstance(inner, dist.ProcessGroup):
        return False
    try:
        devices = inner._device_types
        return bool(devices) and all(isinstance(inner._get_backend(device), gloo) for device in devices)
    except (RuntimeError, AttributeError):
        return False


_NATIVE_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "allgather_coalesced", "_allgather_base",
    "all_gather_single", "all_gather_single_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "alltoall_base", "all_to_all_single", "alltoall", "gather", "scatter",
    "barrier")
"""The collectives a ``_NativeGlooGroup`` leaves to the C++ process group (and so to its native backend)."""

_native: tuple[ModuleType | None] | None = None


def native_module() -> ModuleType | None:
    """The native recorder (``native_recorder.load``), loaded at the first recording gloo group; None records in
    Python: when it is not built, one stderr line says so and how to build it. ``DTPROBE_NATIVE_RECORDER=0`` keeps
    recording in Python, silently."""
    global _native
    if _native is None:
        module = None
        if os.environ.get("DTPROBE_NATIVE_RECORDER", "1") != "0":
            module, why = native_recorder.load()
            if module is None:
                print(f"dtprobe: collectives are recorded in Python, at a higher cost per collective, because the "
                      f"native recorder is not usable: {why}. Build it with `{native_recorder.BUILD_COMMAND}`.",
                      file=sys.stderr, flush=True)
        _native = (module,)
    return _native[0]


def _native_pg_key(group_ref: "weakref.ref[RecordingProcessGroup]") -> tuple[str, bool]:
    """A native backend's question for its group's ``pg`` key: the key, and whether it stays (``_pg_key``)."""
    group = group_ref()
    if group is None:                    # the group is gone while its backend is still used
        return WORLD_GROUP, False
    key = group._pg_key()
    return key, group._key is not None


class _NativeGlooGroup(RecordingProcessGroup):
    """A recording gloo group whose collectives are recorded in C++ (``native_recorder.cpp``).

    A ``RecordingBackend`` around each of the inner group's backends is registered, for the same devices, on this
    group and on ``_direct``, a plain C++ process group. A Python caller's collective (``dist.all_reduce``, FSDP,
    DTensor's waits) is ``_direct``'s own method (instance attributes): no Python frame, and not torch's trampoline
    for Python subclasses, which takes the GIL around the call. A C++ caller (DDP's reducer, functional collectives
    resolving this group by name) goes through that trampoline, finds no Python override and reaches the same
    backend. Rows go to the recorder's native ``Recorder`` and are drained with the Python ones. Point-to-point calls
    stay on the Python path (their per-peer numbering and global peer rank)."""

    def __init__(self, inner: dist.ProcessGroup, rank: int, size: int, *, backend_name: str,
                 recorder: CollectiveRecorder | None = None, device_timing: bool = False,
                 native: bool = True) -> None:
        super().__init__(inner, rank, size, backend_name=backend_name, recorder=recorder)
        module = native_module()
        recorder_native = self._recorder.native(module)
        resolve_key = functools.partial(_native_pg_key, weakref.ref(self))   # no cycle through C++
        self._direct = dist.ProcessGroup(rank, size)
        backends: dict[int, Any] = {}
        for device in inner._device_types:
            backend = inner._get_backend(device)
            wrapped = backends.get(id(backend))
            if wrapped is None:
                wrapped = backends[id(backend)] = module.RecordingBackend(backend, recorder_native, resolve_key)
            for group in (self, self._direct):
                group._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, wrapped)
        for group in (self, self._direct):
            group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        self._native_backends = tuple(backends.values())
        for name in _NATIVE_COLLECTIVES:
            setattr(self, name, getattr(self._direct, name))

    def _set_group_name(self, name: str) -> None:
        super()._set_group_name(name)
        self._direct._set_group_name(name)

    @property
    def dtprobe_name(self) -> str | None:
        """Recording name of this group (axis name); a new one is asked for by the next collective's row."""
        return self.__dict__.get("_dtprobe_name")

    @dtprobe_name.setter
    def dtprobe_name(self, name: str | None) -> None:
        self._dtprobe_name = name
        for backend in self.__dict__.get("_native_backends", ()):
            backend.reset_key()


for _name in _NATIVE_COLLECTIVES:     # C++ callers: the class's own entry (a C++ method), so no Python override
    setattr(_NativeGlooGroup, _name, inspect.getattr_static(dist.ProcessGroup, _name))


# ---- backend registration ----

def _make_gloo(opts: Any, backend_options: Any = None) -> RecordingProcessGroup:
    """Creator for ``dtprobe_gloo`` (extended API: ``opts`` is torch's ``_DistributedBackendOptions``)."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    backend = dist.ProcessGroupGloo(store, rank, size, opts.timeout)
    backend.options.global_ranks_in_group = list(opts.global_ranks_in_group)
    backend.options.group_name = opts.group_id
    backend._set_sequence_number_for_group()
    inner = dist.ProcessGroup(store, rank, size)
    inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return RecordingProcessGroup(inner, rank, size, backend_name=GLOO_BACKEND)


def register_backends() -> None:
    """Register ``dtprobe_gloo`` (cpu) and, when NCCL is built in, ``dtprobe_nccl`` (cuda). Idempotent.

    Both wrap a Python ``ProcessGroup``, so one backend serves one device type: use ``dtprobe_nccl`` on CUDA
    (``"cpu:dtprobe_gloo,cuda:dtprobe_nccl"`` is not supported: torch keeps only the first Python group).
    """
    plugins = dist.Backend._plugins
    if GLOO_BACKEND.upper() not in plugins:
        dist.Backend.register_backend(GLOO_BACKEND, _make_gloo, extended_api=True, devices=["cpu"])
    if dist.is_nccl_available() and NCCL_BACKEND.upper() not in plugins:
        make = functools.partial(nccl.make_nccl, recorder=RECORDER, wrap=functools.partial(
            RecordingProcessGroup, backend_name=NCCL_BACKEND, device_timing=True))
        dist.Backend.register_backend(NCCL_BACKEND, make, extended_api=True, devices=["cuda"])
    torch_internals.install_batch_p2p_coalescing(lambda group: isinstance(group, RecordingProcessGroup))
