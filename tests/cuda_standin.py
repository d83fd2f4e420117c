"""A faithful stand-in of the CUDA / NCCL surface dtprobe's device timing uses, for tests without a GPU.

Same names and signatures as torch 2.13: ``torch.cuda.Event(enable_timing=, blocking=, interprocess=)`` with
``record(stream=None)``, ``query()``, ``synchronize()``, ``elapsed_time(end_event)`` (ms, float; RuntimeError when
an event was not recorded or has not completed, as CUDA's ``cudaErrorNotReady``/``cudaErrorInvalidResourceHandle``),
``torch.cuda.Stream(device=None, priority=0)``, ``torch.cuda.current_stream(device=None)``,
``torch.cuda.nvtx.range_push/range_pop``; the ProcessGroup surface ``_enable_collectives_timing``,
``_register_on_completion_hook``, ``_get_sequence_number_for_group``, ``_start_coalescing``/``_end_coalescing``,
``allreduce``/``send``/``recv``; ``WorkInfo`` with ``op_type`` (the real ``OpType``), ``seq``, ``time_started``/
``time_finished`` (steady-clock ``timedelta`` since boot, as pybind11 converts ``std::chrono::steady_clock``) and
``active_duration`` (``timedelta``).

The simulation: one host clock (``HostClock``: Unix and steady readings, advanced by the test and by waits) and a
device clock that runs at ``1 + drift`` times the host rate from an arbitrary origin. A stream is a queue whose
work ends at ``busy_until`` (device ns); an event recorded on it completes when the device gets there. The NCCL
group keeps ProcessGroupNCCL's counters (``seqCollective_`` per collective and per coalescing block, ``seqP2P_``
per send/recv and per coalescing block with p2p), runs collectives on one stream and p2p on one stream per peer
(after the caller's stream: NCCL's stream waits on it), and queues a ``WorkInfo`` per enqueued work; the test
delivers them (``deliver``) in any order it likes, as the watchdog does across streams.
"""

from __future__ import annotations

import datetime
import types
from typing import Any, Callable

from torch._C._distributed_c10d import OpType

BOOT_UNIX_NS = 1_795_000_000_000_000_000
"""Unix time of the simulated machine's boot (steady clock zero)."""


class HostClock:
    """Unix and steady clocks of the simulated host (ns); ``advance`` moves both."""

    def __init__(self, *, unix_ns: int = BOOT_UNIX_NS + 3_600_000_000_000) -> None:
        self.unix = unix_ns

    def time_ns(self) -> int:
        return self.unix

    def monotonic_ns(self) -> int:
        return self.unix - BOOT_UNIX_NS

    def advance(self, ns: int) -> None:
        self.unix += int(ns)


class Device:
    """The simulated GPU's clock: ``device_ns = origin + (unix - unix0) * (1 + drift)``."""

    def __init__(self, host: HostClock, *, drift: float = 0.0, origin_ns: int = 77_000_000_000,
                 wait_latency_ns: int = 4_000) -> None:
        self.host, self.drift, self.origin = host, drift, origin_ns
        self.unix0 = host.unix
        self.wait_latency_ns = wait_latency_ns
        """Host time between the device reaching an event and a host wait on it returning."""

    def now(self) -> float:
        return self.origin + (self.host.unix - self.unix0) * (1 + self.drift)

    def unix_of(self, device_ns: float) -> int:
        """Unix time at which the device clock reads ``device_ns`` (the truth a resolution should give)."""
        return round(self.unix0 + (device_ns - self.origin) / (1 + self.drift))

    def wait_until(self, device_ns: float) -> None:
        if self.now() < device_ns:
            self.host.unix = self.unix_of(device_ns)
        self.host.advance(self.wait_latency_ns)


class Stream:
    """``torch.cuda.Stream``: work queued on it ends at ``busy_until`` (device ns)."""

    def __init__(self, device: Any = None, priority: int = 0, *, sim: Device) -> None:
        self.device, self.priority, self._sim = device, priority, sim
        self.busy_until = 0.0

    def position(self) -> float:
        """Device time at which work enqueued now would start."""
        return max(self.busy_until, self._sim.now())

    def launch(self, duration_ns: float) -> None:
        """Queue a kernel of ``duration_ns`` (the test's stand-in for GPU work)."""
        self.busy_until = self.position() + duration_ns


class Event:
    """``torch.cuda.Event``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, *,
                 cuda: "StandinCuda") -> None:
        self.enable_timing = enable_timing
        self._cuda = cuda
        self.device_ns: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else self._cuda.current_stream()
        self.device_ns = stream.position()

    def query(self) -> bool:
        return self.device_ns is not None and self._cuda.sim.now() >= self.device_ns

    def synchronize(self) -> None:
        if self.device_ns is not None:
            self._cuda.sim.wait_until(self.device_ns)

    def elapsed_time(self, end_event: "Event") -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.device_ns is None or end_event.device_ns is None:
            raise RuntimeError("CUDA error: invalid resource handle (event not recorded)")
        if not (self.query() and end_event.query()):
            raise RuntimeError("CUDA error: device not ready")
        return (end_event.device_ns - self.device_ns) / 1e6


class _Nvtx:
    def __init__(self) -> None:
        self.stack: list[str] = []
        self.ranges: list[str] = []

    def range_push(self, msg: str) -> int:
        self.stack.append(msg)
        return len(self.stack) - 1

    def range_pop(self) -> int:
        self.ranges.append(self.stack.pop())
        return len(self.stack)


class StandinCuda:
    """The ``torch.cuda`` module surface: ``Event``, ``Stream``, ``current_stream``, ``synchronize``, ``nvtx``."""

    def __init__(self, sim: Device) -> None:
        self.sim = sim
        self.nvtx = _Nvtx()
        self.compute = Stream(sim=sim)
        """The caller's current stream."""
        self.events_created = 0

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> Event:  # noqa: N802
        self.events_created += 1
        return Event(enable_timing, blocking, interprocess, cuda=self)

    def Stream(self, device: Any = None, priority: int = 0) -> Stream:  # noqa: N802
        return Stream(device, priority, sim=self.sim)

    def current_stream(self, device: Any = None) -> Stream:
        return self.compute

    def synchronize(self, device: Any = None) -> None:
        self.sim.wait_until(self.compute.busy_until)


def work_info(op_type: OpType, seq: int, *, started_ns: int, finished_ns: int, active_ns: float) -> Any:
    """A ``WorkInfo`` as torch 2.13 hands it to the hook: steady-clock timedeltas (µs resolution)."""
    steady = lambda ns: datetime.timedelta(microseconds=(ns - BOOT_UNIX_NS) // 1000)   # noqa: E731
    return types.SimpleNamespace(op_type=op_type, seq=seq, time_started=steady(started_ns),
                                 time_finished=steady(finished_ns),
                                 active_duration=datetime.timedelta(microseconds=active_ns / 1000))


class StandinWork:
    """A ProcessGroupNCCL work: ``is_completed`` queries its end on the device."""

    def __init__(self, sim: Device, end_device_ns: float) -> None:
        self._sim, self.end_device_ns = sim, end_device_ns

    def is_completed(self) -> bool:
        return self._sim.now() >= self.end_device_ns

    def wait(self, timeout: Any = None) -> bool:
        return True


class StandinNcclGroup:
    """The inner ProcessGroup holding a ProcessGroupNCCL (see the module docstring). ``durations`` gives each
    op's transfer time on the device (ns), in issue order; ``truth`` keeps, per issued op, the device times a
    correct recorder must report (``arrive``, ``start``, ``end``)."""

    def __init__(self, cuda: StandinCuda, *, rank: int = 0, durations: list[float]) -> None:
        self.cuda, self.sim = cuda, cuda.sim
        self.rank = rank
        self._durations = list(durations)
        self.timing = False
        self.hook: Callable[[Any], None] | None = None
        self.seq_collective = 0
        self.seq_p2p = 0
        self._coalescing = False
        self._coalesced_p2p = False
        self._block: list[dict[str, Any]] = []
        self.streams: dict[Any, Stream] = {}
        self.infos: list[Any] = []
        """WorkInfo of every enqueued work, in issue order (not delivered until ``deliver``)."""
        self.stream_of_info: list[Any] = []
        """The NCCL stream each of ``infos`` ran on (works on one stream complete in order)."""
        self.truth: list[dict[str, Any]] = []

    # ---- ProcessGroup private surface ----
    def _enable_collectives_timing(self) -> None:
        self.timing = True

    def _register_on_completion_hook(self, hook: Callable[[Any], None]) -> None:
        if not self.timing:
            raise RuntimeError("ProcessGroupNCCL OnCompletion hook requires timing (TORCH_NCCL_ENABLE_TIMING or "
                               "_enable_collectives_timing)")
        self.hook = hook

    def _get_sequence_number_for_group(self) -> int:
        return self.seq_collective

    def _set_group_name(self, name: str) -> None:
        pass

    def _get_backend(self, device: Any) -> "StandinBackend":
        return StandinBackend()

    def _start_coalescing(self, device: Any) -> None:
        self.seq_collective += 1          # ProcessGroupNCCL bumps the collective counter at every block start
        self._coalescing, self._coalesced_p2p, self._block = True, False, []

    def _end_coalescing(self, device: Any) -> StandinWork:
        ops, self._block = self._block, []
        p2p = self._coalesced_p2p
        self._coalescing = self._coalesced_p2p = False
        seq = self.seq_p2p if p2p else self.seq_collective
        return self._run(OpType.COALESCED, seq, "coll", ops)

    # ---- ops ----
    def allreduce(self, tensors: Any, *args: Any) -> StandinWork | None:
        if not self._coalescing:
            self.seq_collective += 1
        return self._op(OpType.ALLREDUCE, self.seq_collective, "coll")

    def allreduce_coalesced(self, tensors: Any, *args: Any) -> StandinWork | None:
        # ProcessGroupNCCL::collectiveCoalesced: one counter bump, one COALESCED work for all the tensors
        self.seq_collective += 1
        op = {"arrive": self.cuda.compute.position(), "duration": self._durations.pop(0), "issued": self.sim.host.unix}
        return self._run(OpType.COALESCED, self.seq_collective, "coll", [op])

    def send(self, tensors: Any, dst: int, tag: int = 0) -> StandinWork | None:
        return self._op(OpType.SEND, self._p2p_seq(), ("p2p", dst))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> StandinWork | None:
        return self._op(OpType.RECV, self._p2p_seq(), ("p2p", src))

    def _p2p_seq(self) -> int:
        if not self._coalescing:
            self.seq_p2p += 1
        elif not self._coalesced_p2p:
            self.seq_p2p += 1
            self._coalesced_p2p = True
        return self.seq_p2p

    def _op(self, op_type: OpType, seq: int, stream_key: Any) -> StandinWork | None:
        op = {"arrive": self.cuda.compute.position(), "duration": self._durations.pop(0), "issued": self.sim.host.unix}
        if self._coalescing:
            self._block.append(op)
            return None
        return self._run(op_type, seq, stream_key, [op])

    def _run(self, op_type: OpType, seq: int, stream_key: Any, ops: list[dict[str, Any]]) -> StandinWork:
        stream = self.streams.setdefault(stream_key, Stream(sim=self.sim))
        start = max([stream.busy_until] + [op["arrive"] for op in ops])
        duration = sum(op["duration"] for op in ops)
        stream.busy_until = start + duration
        for op in ops:
            self.truth.append({"arrive": op["arrive"], "start": start, "end": start + duration, "seq": seq,
                               "op_type": op_type})
        if self.timing:
            self.infos.append(work_info(op_type, seq, started_ns=ops[0]["issued"],
                                        finished_ns=0, active_ns=duration))
            self.infos[-1].end_device_ns = start + duration
            self.stream_of_info.append(stream_key)
        return StandinWork(self.sim, start + duration)

    def deliver(self, order: list[int] | None = None) -> None:
        """Run the device past every queued work and call the hook for each (``order``: indexes into
        ``infos``), as the watchdog does: ``time_finished`` is when it noticed, after the device finished."""
        last = max(i.end_device_ns for i in self.infos)
        self.sim.wait_until(last)
        for i in (order if order is not None else range(len(self.infos))):
            info = self.infos[i]
            noticed = self.sim.unix_of(info.end_device_ns) + 30_000_000     # the watchdog polls: late by up to 100 ms
            info.time_finished = datetime.timedelta(microseconds=(noticed - BOOT_UNIX_NS) // 1000)
            assert self.hook is not None
            self.hook(info)


class StandinBackend:
    """``ProcessGroup._get_backend(device)``'s answer for NCCL: a backend that supports coalescing."""

    supports_coalescing = True
