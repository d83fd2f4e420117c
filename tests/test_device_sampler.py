"""Device sampler in one process: the NVML reader and sampler against a fake pynvml, and the host-metrics fallback
when the NVML library is missing."""

from __future__ import annotations

import time
import types

from dtprobe.collectors import devices

from collector_fakes import ListWriter


# ---------------------------------------------------------------------------------------------- NVML stand-in

class FakeNvml:
    """Just enough of pynvml: one GPU with known readings, NVLink counters that advance, one XID event."""

    class NVMLError(Exception):
        pass

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
    nvmlEventTypeXidCriticalError = 8

    def __init__(self) -> None:
        self.nvlink_kib = 0
        self.pending_xids = [79]
        self.shutdown = False

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shutdown = True
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, i): return ("gpu", i)
    def nvmlDeviceGetUtilizationRates(self, h): return types.SimpleNamespace(gpu=87, memory=40)
    def nvmlDeviceGetMemoryInfo(self, h): return types.SimpleNamespace(used=30 * 2**30, total=80 * 2**30)
    def nvmlDeviceGetPowerUsage(self, h): return 350_500            # mW
    def nvmlDeviceGetEnforcedPowerLimit(self, h): return 400_000    # mW
    def nvmlDeviceGetTemperature(self, h, sensor): return 71
    def nvmlDeviceGetClockInfo(self, h, clock): return 1410
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h): return 0x4   # SW power cap
    def nvmlDeviceGetPcieThroughput(self, h, counter): return 1000 if counter == 0 else 2000   # KB/s

    def nvmlDeviceGetFieldValues(self, h, ids):
        self.nvlink_kib += 1024
        return [types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(ullVal=self.nvlink_kib * k))
                for k in (1, 2)]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != "GPU-abc":
            raise self.NVMLError("not found")
        return ("gpu", 0)

    def nvmlDeviceGetIndex(self, h): return h[1]

    def nvmlEventSetCreate(self): return "event-set"
    def nvmlDeviceRegisterEvents(self, h, types_, event_set): pass

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        if not self.pending_xids:
            raise self.NVMLError("timeout")
        return types.SimpleNamespace(eventData=self.pending_xids.pop(0))


def test_nvml_sampler_writes_known_readings_when_nvml_is_present(monkeypatch):
    clock = iter([100.0, 102.0, 104.0, 106.0])
    monkeypatch.setattr(devices.time, "monotonic", lambda: next(clock))
    fake, writer = FakeNvml(), ListWriter()
    sampler = devices.DeviceSampler(writer, interval_s=60, gpu_index=0, nvml=fake, step_fn=lambda: 7)
    assert sampler.source == "nvml"
    sampler.sample_once()
    sampler.sample_once()
    rows = writer.table("devices")
    xid_rows = [r for r in rows if "xid" in r]
    first, second = [r for r in rows if "xid" not in r]
    assert [r["xid"] for r in xid_rows] == [79]
    assert first["source"] == "nvml" and first["gpu"] == 0 and first["step"] == 7
    assert (first["util_frac"], first["mem_util_frac"]) == (0.87, 0.40)
    assert (first["mem_used_bytes"], first["mem_total_bytes"]) == (30 * 2**30, 80 * 2**30)
    assert (first["power_w"], first["power_limit_w"], first["temp_c"], first["sm_clock_mhz"]) == (
        350.5, 400.0, 71.0, 1410.0)
    assert first["throttle_reasons"] == 0x4
    assert (first["pcie_tx_bytes_per_s"], first["pcie_rx_bytes_per_s"]) == (1000 * 1024.0, 2000 * 1024.0)
    assert "nvlink_tx_bytes_per_s" not in first                    # a rate needs two counter readings
    # counters advanced 1024 KiB (tx) and 2048 KiB (rx) in 2 s
    assert (second["nvlink_tx_bytes_per_s"], second["nvlink_rx_bytes_per_s"]) == (512 * 1024.0, 1024 * 1024.0)
    assert first["rss_bytes"] > 0 and "cpu_frac" in first           # the process's host metrics ride along


def test_nvml_reader_is_found_by_cuda_uuid_not_by_the_visible_index():
    reader = devices.open_nvml(5, FakeNvml(), uuid="abc")      # CUDA index 5 under CUDA_VISIBLE_DEVICES
    assert reader is not None and reader.index == 0
    assert devices.open_nvml(5, FakeNvml(), uuid="zzz") is None    # unknown uuid, no NVML index 5


def test_nvml_sampler_samples_at_start_and_close_and_shuts_nvml_down():
    fake, writer = FakeNvml(), ListWriter()
    sampler = devices.DeviceSampler(writer, interval_s=60, gpu_index=0, nvml=fake)
    sampler.start()
    sampler.close()
    assert len([r for r in writer.table("devices") if "xid" not in r]) == 2 and fake.shutdown


def test_device_sampler_falls_back_to_host_metrics_when_nvml_library_is_missing():
    writer = ListWriter()
    sampler = devices.DeviceSampler(writer, interval_s=0.05, gpu_index=0)   # the real pynvml: no library here
    assert sampler.source == "host"
    sampler.start()
    time.sleep(0.3)
    sampler.close()
    rows = writer.table("devices")
    assert len(rows) >= 3 and {r["source"] for r in rows} == {"host"}
    assert all(r["rss_bytes"] > 0 and 0 <= r["cpu_frac"] <= 1 and "gpu" not in r for r in rows)


