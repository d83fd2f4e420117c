"""Device sampler thread: NVML (GPU util, memory, power, clocks, throttle, PCIe/NVLink, XID) or host metrics
(this process's CPU and RSS, load1, the CPU time its cgroup's quota withheld) when NVML is absent; writes
``devices`` rows (``source`` nvml/host)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Callable

import psutil


def _load_pynvml() -> Any:
    import pynvml

    return pynvml


class NvmlReader:
    """Reads one GPU through ``pynvml``; every metric the device does not support is left out of the row."""

    def __init__(self, nvml: Any, index: int) -> None:
        self.nvml = nvml
        self.index = index
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self._nvlink_prev: tuple[float, float, float] | None = None   # (time_s, tx_kib, rx_kib)
        self._events = self._register_xid_events()

    def _try(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self.nvml.NVMLError:
            return None

    def _register_xid_events(self) -> Any:
        nvml = self.nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(self.handle, nvml.nvmlEventTypeXidCriticalError, event_set)
            return event_set
        except (nvml.NVMLError, AttributeError):
            return None

    def poll_xids(self) -> list[int]:
        """XID error codes raised since the last poll (non-blocking)."""
        if self._events is None:
            return []
        nvml = self.nvml
        xids = []
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:      # NVML_ERROR_TIMEOUT: nothing pending
                return xids
            xids.append(int(data.eventData))

    def sample(self) -> dict[str, Any]:
        nvml, h = self.nvml, self.handle
        row: dict[str, Any] = {"source": "nvml", "gpu": self.index}
        util = self._try(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            row["util_frac"] = util.gpu / 100.0
            row["mem_util_frac"] = util.memory / 100.0
        mem = self._try(lambda: nvml.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            row["mem_used_bytes"] = int(mem.used)
            row["mem_total_bytes"] = int(mem.total)
        power = self._try(lambda: nvml.nvmlDeviceGetPowerUsage(h))
        if power is not None:
            row["power_w"] = power / 1000.0
        limit = self._try(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h))
        if limit is not None:
            row["power_limit_w"] = limit / 1000.0
        temp = self._try(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        if temp is not None:
            row["temp_c"] = float(temp)
        clock = self._try(lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
        if clock is not None:
            row["sm_clock_mhz"] = float(clock)
        get_reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                       or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        reasons = self._try(lambda: get_reasons(h))
        if reasons is not None:
            row["throttle_reasons"] = int(reasons)
        tx = self._try(lambda: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES))
        rx = self._try(lambda: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES))
        if tx is not None:
            row["pcie_tx_bytes_per_s"] = tx * 1024.0       # NVML reports KB/s
        if rx is not None:
            row["pcie_rx_bytes_per_s"] = rx * 1024.0
        row.update(self._nvlink_rates())
        return row

    def _nvlink_rates(self) -> dict[str, float]:
        nvml = self.nvml
        fields = getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", None), \
            getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", None)
        if None in fields:
            return {}
        values = self._try(lambda: nvml.nvmlDeviceGetFieldValues(self.handle, list(fields)))
        if not values or any(getattr(v, "nvmlReturn", 0) != 0 for v in values):
            return {}
        now = time.monotonic()
        tx_kib, rx_kib = (float(v.value.ullVal) for v in values)   # cumulative KiB since driver load
        prev, self._nvlink_prev = self._nvlink_prev, (now, tx_kib, rx_kib)
        if prev is None or now <= prev[0]:
            return {}
        dt = now - prev[0]
        return {"nvlink_tx_bytes_per_s": (tx_kib - prev[1]) * 1024.0 / dt,
                "nvlink_rx_bytes_per_s": (rx_kib - prev[2]) * 1024.0 / dt}


CGROUP_ROOT = "/sys/fs/cgroup"


class CpuThrottle:
    """How long this process's CPU cgroup has been held back by its CFS bandwidth quota (``cpu.cfs_quota_us`` in
    cgroup v1, ``cpu.max`` in v2; a container's CPU limit): the kernel's ``throttled_time`` (v1, ns) or
    ``throttled_usec`` (v2) of the cgroup's ``cpu.stat``, summed over the cgroup's CPUs. ``read`` returns that time
    accumulated since the first read, following the process when it is moved to another cgroup (a move adds
    nothing: the new cgroup's earlier throttling was not this process's), so the value only grows; None where no
    cgroup reports it (no CPU controller mounted, a v2 root). A rank throttled while its peers are not computes
    slower for reasons outside the job: the CPU analog of NVML's throttle reasons."""

    def __init__(self, *, proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> None:
        self._proc_cgroup, self._root = proc_cgroup, root
        self._last: tuple[str, int] | None = None       # (cpu.stat path, its throttled ns) at the latest read
        self._total = 0

    def _stat_path(self) -> str | None:
        """The ``cpu.stat`` of this process's CPU cgroup (v1 ``cpu`` controller, else the v2 unified one)."""
        try:
            with open(self._proc_cgroup) as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        unified = None
        for line in lines:
            if line.count(":") < 2:                     # not "id:controllers:path"
                continue
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                    candidate = os.path.join(self._root, mount, path.lstrip("/"), "cpu.stat")
                    if os.path.exists(candidate):
                        return candidate
            elif controllers == "":
                unified = os.path.join(self._root, path.lstrip("/"), "cpu.stat")
        return unified if unified is not None and os.path.exists(unified) else None

    @staticmethod
    def _throttled_ns(stat_path: str) -> int | None:
        try:
            with open(stat_path) as f:
                fields = dict(line.split() for line in f if line.count(" ") == 1)
        except (OSError, ValueError):
            return None
        if "throttled_time" in fields:
            return int(fields["throttled_time"])
        if "throttled_usec" in fields:
            return int(fields["throttled_usec"]) * 1000
        return None

    def read(self) -> int | None:
        path = self._stat_path()
        value = self._throttled_ns(path) if path is not None else None
        if value is None:
            return None if self._last is None else self._total
        if self._last is not None and self._last[0] == path:
            self._total += max(0, value - self._last[1])
        self._last = (path, value)
        return self._total


class RunQueueWait:
    """How long a thread (by default the process's main thread, where a training loop runs) has been runnable but
    waiting for a CPU: the second field of the kernel's ``/proc/self/task/<tid>/schedstat`` (``run_delay``, ns,
    since the thread started). Another process or thread on the same core shows here, and so does time a cgroup's
    CPU quota throttles the thread (``CpuThrottle`` tells those apart); a core the host runs slower does not. None
    where the kernel keeps no schedstat."""

    def __init__(self, tid: int | None = None, *, proc: str = "/proc") -> None:
        tid = threading.main_thread().native_id if tid is None else tid
        self._path = os.path.join(proc, "self", "task", str(tid), "schedstat")

    def read(self) -> int | None:
        try:
            with open(self._path) as f:
                return int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            return None


class HostReader:
    """This process's CPU share of the machine (0..1, all cores = 1), its CPU time so far (``cpu_time_ns``: user +
    system of all its threads since it started), RSS, CPU time withheld by its cgroup's quota
    (``cpu_throttled_ns``, ``CpuThrottle``), its main thread's time waiting for a CPU (``cpu_wait_ns``,
    ``RunQueueWait``), and the host's 1-minute load.

    The kernel counts process CPU time in clock ticks, so over a short window the CPU time can run a tick ahead
    of the wall time (psutil's ``cpu_percent`` then reports several hundred percent for a 1 ms interval). Each
    ``cpu_frac`` is therefore taken over a window of at least ``MIN_WINDOW_S``: a sample that comes sooner (the
    sampler's first sample, or the last one at close) is measured from the reference before the latest one, and
    the first reference is the process's start. The rest of the tick error is clipped to the physical bound 1.
    """

    MIN_WINDOW_S = 0.25

    def __init__(self) -> None:
        self.process = psutil.Process(os.getpid())
        self.num_cpus = psutil.cpu_count() or 1
        start = (_process_start(), 0.0)
        self._refs = [start, start]             # (monotonic_s, cpu_s): older and latest window starts
        self.throttle = CpuThrottle()
        self.run_queue = RunQueueWait()

    def _cpu_seconds(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def cpu_frac(self, cpu: float | None = None) -> float:
        """The share over the window (class docstring); ``cpu``: the process's CPU seconds now, when just read."""
        now, cpu = _boot_clock(), self._cpu_seconds() if cpu is None else cpu
        older, latest = self._refs
        if now - latest[0] >= self.MIN_WINDOW_S:
            ref, self._refs = latest, [latest, (now, cpu)]
        else:
            ref = older
        elapsed = now - ref[0]
        if elapsed <= 0:
            return 0.0
        return min(1.0, max(0.0, (cpu - ref[1]) / elapsed / self.num_cpus))

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"source": "host"}
        row.update(self.process_metrics())
        return row

    def process_metrics(self) -> dict[str, Any]:
        with self.process.oneshot():
            cpu = self._cpu_seconds()
            cpu_frac = self.cpu_frac(cpu)
            rss = self.process.memory_info().rss
        row = {"cpu_frac": cpu_frac, "cpu_time_ns": int(round(cpu * 1e9)), "rss_bytes": int(rss),
               "load1": os.getloadavg()[0]}
        throttled = self.throttle.read()
        if throttled is not None:
            row["cpu_throttled_ns"] = throttled
        waited = self.run_queue.read()
        if waited is not None:
            row["cpu_wait_ns"] = waited
        return row


def _boot_clock() -> float:
    """Seconds since boot (CLOCK_BOOTTIME, the clock of /proc's process start time); monotonic elsewhere."""
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock_id) if clock_id is not None else time.monotonic()


def _process_start() -> float:
    """When this process started, on ``_boot_clock``: /proc's start time (clock ticks since boot) where there is
    one, else now (the first window then starts here)."""
    now = _boot_clock()
    if getattr(time, "CLOCK_BOOTTIME", None) is None:
        return now
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22 of proc(5); fields[0] is field 3
    except (OSError, IndexError, ValueError):
        return now
    return min(now, started)


def open_nvml(gpu_index: int, nvml: Any = None, *, uuid: str | None = None) -> NvmlReader | None:
    """An ``NvmlReader`` for the GPU with ``uuid`` (CUDA's device uuid; robust to CUDA_VISIBLE_DEVICES, which
    NVML ignores) or else NVML index ``gpu_index``; None when NVML is absent (no driver / library / that GPU)."""
    try:
        nvml = nvml or _load_pynvml()
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
        if uuid is not None:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
                gpu_index = int(nvml.nvmlDeviceGetIndex(handle))
            except (nvml.NVMLError, AttributeError):
                pass
        if gpu_index >= nvml.nvmlDeviceGetCount():
            return None
        return NvmlReader(nvml, gpu_index)
    except nvml.NVMLError:
        return None


class DeviceSampler:
    """Background thread writing a ``devices`` row every ``interval_s`` (and at ``start`` and ``close``).

    NVML rows describe this rank's GPU (``gpu`` = local CUDA index) and carry the process's CPU/RSS too; host
    rows (no NVML) carry only the process CPU/RSS and load1.
    """

    def __init__(self, writer: Any, *, interval_s: float, gpu_index: int | None,
                 step_fn: Callable[[], int] = lambda: -1, nvml: Any = None, gpu_uuid: str | None = None) -> None:
        self.writer = writer
        self.interval_s = interval_s
        self.step_fn = step_fn
        self.host = socket.gethostname()
        self.host_reader = HostReader()
        self.nvml_reader = open_nvml(gpu_index, nvml, uuid=gpu_uuid) if gpu_index is not None else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def source(self) -> str:
        return "nvml" if self.nvml_reader is not None else "host"

    def sample_once(self) -> None:
        """Take one sample now and write it (and one row per XID event seen since the last sample)."""
        with self._lock:
            now = time.time_ns()
            step = self.step_fn()
            if self.nvml_reader is not None:
                row = self.nvml_reader.sample()
                row.update(self.host_reader.process_metrics())
                xids = self.nvml_reader.poll_xids()
            else:
                row = self.host_reader.sample()
                xids = []
            row.update(host=self.host, time_ns=now, step=step)
            self.writer.write("devices", row)
            for xid in xids:
                self.writer.write("devices", {"host": self.host, "time_ns": now, "step": step, "source": "nvml",
                                              "gpu": row.get("gpu"), "xid": xid})

    def start(self) -> None:
        self.sample_once()
        self._thread = threading.Thread(target=self._run, name="dtprobe-devices", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    def close(self) -> None:
        """Stop the thread and take a last sample."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
        self.sample_once()
        if self.nvml_reader is not None:
            try:
                self.nvml_reader.nvml.nvmlShutdown()
            except self.nvml_reader.nvml.NVMLError:
                pass
