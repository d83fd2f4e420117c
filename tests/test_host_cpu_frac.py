"""HostReader's ``cpu_frac``: this process's share of all cores over a window long enough for the kernel's tick
granularity, so a sample taken right after the previous one still reads 0..1 (docs/run-store.md, ``devices``)."""

from __future__ import annotations

import time

import pytest

from dtprobe.collectors import devices


@pytest.fixture
def reader(monkeypatch):
    clock = {"now": 100.0, "cpu": 0.0}
    monkeypatch.setattr(devices, "_process_start", lambda: 100.0)
    monkeypatch.setattr(devices, "_boot_clock", lambda: clock["now"])
    host = devices.HostReader()
    host.num_cpus = 2
    monkeypatch.setattr(host, "_cpu_seconds", lambda: clock["cpu"])
    return host, clock


def test_a_sample_one_ms_after_the_last_reads_over_the_window_before_it(reader):
    host, clock = reader
    clock.update(now=110.0, cpu=5.0)
    assert host.cpu_frac() == pytest.approx(5.0 / 10.0 / 2)            # first window: since the process started
    clock.update(now=110.001, cpu=5.01)                                 # one 10 ms tick counted in 1 ms
    assert host.cpu_frac() == pytest.approx(5.01 / 10.001 / 2)          # measured from 100, not from 110
    clock.update(now=110.5, cpu=5.5)
    assert host.cpu_frac() == pytest.approx(0.5 / 0.5 / 2)              # a full window from 110


def test_tick_overshoot_is_clipped_to_all_cores(reader):
    host, clock = reader
    clock.update(now=100.1, cpu=0.21)                                   # 0.1 s old, two ticks ahead on 2 cores
    assert host.cpu_frac() == 1.0


def test_real_reader_right_after_start_stays_within_one():
    values = []
    for _ in range(50):
        host = devices.HostReader()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.002:                         # a short busy interval, as at close
            pass
        values.append(host.process_metrics()["cpu_frac"])
    assert all(0 <= v <= 1 for v in values), max(values)


def test_cpu_time_counts_every_thread_of_the_process():
    # cpu_time_ns (the straggler finding's off-CPU check reads its growth per step): user + system of all threads,
    # so work on another thread counts, and a sleep adds nothing
    import threading

    host = devices.HostReader()
    before = host.process_metrics()["cpu_time_ns"]
    time.sleep(0.3)
    slept = host.process_metrics()["cpu_time_ns"] - before

    def burn() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.3:
            pass

    worker = threading.Thread(target=burn)
    start = host.process_metrics()["cpu_time_ns"]
    worker.start()
    worker.join()
    burnt = host.process_metrics()["cpu_time_ns"] - start
    assert slept < 0.1e9 and burnt >= 0.28e9, (slept, burnt)
