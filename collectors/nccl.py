"""NCCL side of the recording process group (``dtprobe_nccl``): builds the group, times its collectives on the device.

``make_nccl`` builds a ProcessGroupNCCL as ``init_process_group("nccl")`` would and hands it to the recording
wrapper (``collectors.pg_wrapper``, which registers the backend); ``NcclCompletionMatcher`` pairs NCCL's
completion-hook ``WorkInfo`` with the rows the wrapper issued and writes them (``collectives`` table). Read by
``dtprobe.store`` and the hang watchdog through the recorder.
"""

from __future__ import annotations

import collections
import datetime
import os
import threading
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

def _to_ns(value: Any) -> int | None:
    """A WorkInfo time (datetime, timedelta, or a number of ns) as integer nanoseconds; None if unknown."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        # pybind11 turns std::chrono::system_clock into a naive datetime in LOCAL time, which is what
        # ``timestamp()`` assumes for naive values; aware values convert exactly. (Microsecond resolution.)
        return int(round(value.timestamp() * 1e6)) * 1000
    if isinstance(value, datetime.timedelta):
        return (value.days * 86_400 + value.seconds) * 1_000_000_000 + value.microseconds * 1_000
    return int(value)



class NcclCompletionMatcher:
    """Pairs NCCL ``WorkInfo`` completions with the rows issued on one group and writes them.

    NCCL completes a group's collectives in issue order (one stream) and its p2p ops in issue order per peer
    stream; the watchdog reports them in that order, so a FIFO per kind (collective / p2p) pairs them.
    ``WorkInfo``: ``time_started`` (host call), ``time_finished`` (watchdog saw completion),
    ``active_duration`` (CUDA-event duration launch -> completion). Rows get ``end_ns = time_finished`` and
    ``start_ns = end_ns - active_duration``, ``timing="cuda_event"``.
    """

    _P2P_TYPES = ("SEND", "RECV", "RECVANYSOURCE")

    def __init__(self, recorder: Any) -> None:
        self._recorder = recorder
        self._queues: dict[bool, collections.deque] = {False: collections.deque(), True: collections.deque()}
        self._lock = threading.Lock()

    def expect(self, row: dict[str, Any], *, is_p2p: bool) -> None:
        key = self._recorder.track(row)
        with self._lock:
            self._queues[is_p2p].append((key, row))

    def on_completion(self, info: Any) -> None:
        op_type = str(getattr(info, "op_type", "")).rsplit(".", 1)[-1].upper()
        is_p2p = op_type in self._P2P_TYPES
        with self._lock:
            queue = self._queues[is_p2p]
            if not queue:
                return                # a collective issued before recording started, or not recorded
            key, row = queue.popleft()
        if not self._recorder.untrack(key):
            return
        end_ns = _to_ns(getattr(info, "time_finished", None))
        duration_ns = _to_ns(getattr(info, "active_duration", None))
        row["end_ns"] = end_ns
        if end_ns is not None and duration_ns is not None and duration_ns >= 0:
            row["start_ns"] = end_ns - duration_ns
        row["timing"] = "cuda_event"
        self._recorder.emit(row)


def enable_completion_timing(inner: Any, recorder: Any) -> NcclCompletionMatcher | None:
    """Take device timings from ``inner``'s NCCL completion hook; None (with a warning) if unavailable."""
    try:
        matcher = NcclCompletionMatcher(recorder)
        inner._register_on_completion_hook(matcher.on_completion)
    except (RuntimeError, AttributeError) as exc:
        warnings.warn(f"dtprobe: NCCL completion hook unavailable ({exc}); collectives get no end time.",
                      stacklevel=3)
        return None
    return matcher


def make_nccl(opts: Any, backend_options: Any = None, *, wrap: Callable[..., Any], recorder: Any) -> Any:
    """Creator for ``dtprobe_nccl``: a ProcessGroupNCCL built as ``init_process_group("nccl")`` would
    (``pg_options`` of type ``ProcessGroupNCCL.Options`` are honoured), held by a plain ProcessGroup so the
    completion hook can be registered on it;
    ``wrap(inner, rank, size)`` makes the recording group around it."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    options = backend_options if backend_options is not None else dist.ProcessGroupNCCL.Options()
    if backend_options is None:
        options.is_high_priority_stream = False
    options._timeout = opts.timeout
    options.global_ranks_in_group = list(opts.global_ranks_in_group)
    options.group_name = opts.group_id
    backend = dist.ProcessGroupNCCL(store, rank, size, options)
    backend._set_sequence_number_for_group()
    inner = dist.ProcessGroup(store, rank, size)
    inner._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
    inner._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    pg = wrap(inner, rank, size)
    if recorder.nccl_timing and os.environ.get("TORCH_NCCL_ENABLE_TIMING") == "1":
        pg.enable_completion_timing()
    return pg
