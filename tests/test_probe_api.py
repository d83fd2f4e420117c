"""The probe's API in one process: step phases summed over micro-batches, unknown phase and record names refused,
``CollectConfig`` and ``attach`` errors naming the key, and a ``NullProbe`` that offers every public member."""

from __future__ import annotations

import inspect

import pytest
import torch

from dtprobe.collectors.attach import Probe, attach
from dtprobe.collectors.config import CollectConfig
from dtprobe.collectors.null import NullProbe
from dtprobe.collectors.training import StepContext
from dtprobe.store.errors import ConfigError


# ---------------------------------------------------------------------------------------------- steps

def test_step_phases_accumulate_over_micro_batches(monkeypatch):
    from dtprobe.collectors import training

    ticks = iter([0, 30, 30, 40, 40, 70, 70, 80])       # fwd 0-30, bwd 30-40, fwd 40-70, bwd 70-80 (ms)
    monkeypatch.setattr(training.time, "perf_counter_ns", lambda: next(ticks) * 1_000_000)
    written = []
    with StepContext(5, on_enter=lambda s: None, on_exit=written.append) as s:
        for _ in range(2):
            with s.phase("fwd"):
                pass
            with s.phase("bwd"):
                pass
        s.record(loss=torch.tensor(2.5), tokens=torch.tensor(128), lr=1e-3)
    row = written[0].row(restart=1)
    assert row["step"] == 5 and row["restart"] == 1
    assert (row["fwd_ns"], row["bwd_ns"]) == (60_000_000, 20_000_000)
    assert row["start_ns"] <= row["end_ns"]
    assert (row["loss"], row["tokens"], row["lr"]) == (2.5, 128, 1e-3) and "data_ns" not in row


@pytest.mark.parametrize("call,match", [
    (lambda s: s.phase("forward"), "not one of"),
    (lambda s: s.record(accuracy=0.5), "accuracy"),
])
def test_step_context_rejects_unknown_names(call, match):
    s = StepContext(0, on_enter=lambda s: None, on_exit=lambda s: None)
    with pytest.raises(ConfigError, match=match):
        call(s)


# ---------------------------------------------------------------------------------------------- config / API

@pytest.mark.parametrize("kwargs,match", [
    ({"profile_steps": (11, 10)}, "profile_steps"),
    ({"profile_steps": (10,)}, "profile_steps"),
    ({"device_interval_s": 0}, "device_interval_s"),
    ({"collective_timing": "always"}, "collective_timing"),
    ({"clock_rounds": 0}, "clock_rounds"),
])
def test_collect_config_rejects_bad_values_naming_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        CollectConfig(**kwargs)


def test_attach_rejects_unknown_options_before_touching_torch_distributed():
    with pytest.raises(ConfigError, match="profile_step"):
        attach("unused", profile_step=(1, 2))
    assert not torch.distributed.is_initialized()


def test_null_probe_offers_every_public_probe_method_and_attribute():
    public = {n for n, _ in inspect.getmembers(Probe) if not n.startswith("_")}
    assert public <= {n for n in dir(NullProbe(rank=0)) if not n.startswith("_")}
    probe = NullProbe(rank=1)
    with probe.step(3) as s:
        with s.phase("fwd"):
            pass
        s.record(loss=1.0)
    probe.fault("crash", injected=True)
    probe.close()
    assert not probe.is_leader and int(s) == 3


