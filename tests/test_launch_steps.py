"""``collectors/launch_steps.ScriptSteps`` on a real 1-rank probe: steps from optimizer steps (gradient
accumulation, a nested optimizer step, an activation-checkpointed block), values from ``dtprobe.record`` only,
an open step without an optimizer step dropped, hooks gone after ``close``."""

from __future__ import annotations

import textwrap

import pandas as pd
import pytest

from dtprobe.store import RunStore

_SCRIPT = """
import torch, dtprobe
from torch import nn
from torch.utils.checkpoint import checkpoint
from dtprobe.collectors.launch_steps import ScriptSteps

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.block, self.b = nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 1)
    def forward(self, x):
        return self.b(checkpoint(self.block, self.a(x), use_reentrant=False))

class Outer(torch.optim.SGD):
    # steps an inner optimizer inside its own step, as ZeroRedundancyOptimizer does: one step attempt
    def __init__(self, params):
        params = list(params)
        super().__init__(params, lr=0.1)
        self.inner = torch.optim.SGD(params, lr=0.05)
    def step(self, closure=None):
        return self.inner.step()

probe = dtprobe.attach({run!r}, devices=False)
steps = ScriptSteps(probe)
steps.install()
dtprobe._record_sink = steps.record
torch.manual_seed(0)
model, losses = Net(), []
opt = Outer(model.parameters())
for i in range(6):                                   # 6 micro-batches, an optimizer step every 3
    loss = model(torch.randn(4, 8)).square().mean()
    (loss / 3).backward()
    dtprobe.record(loss=loss.detach(), tokens=4)
    losses.append(loss.item())
    if i % 3 == 2:
        opt.step()
        opt.zero_grad()
with torch.no_grad():
    model(torch.randn(4, 8))                         # evaluation after the last step: no step row
steps.close()
dtprobe._record_sink = None
opt.step()                                           # hooks removed: no row
probe.close()
print(sum(losses[:3]) / 3, sum(losses[3:]) / 3)
"""


def test_script_steps_makes_one_step_per_outer_optimizer_step_with_recorded_values(tmp_path, run_python):
    run = tmp_path / "run"
    proc = run_python(textwrap.dedent(_SCRIPT.format(run=str(run))), timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mean_losses = [float(v) for v in proc.stdout.split()]
    steps = RunStore.open(run).table("steps").sort_values("step")
    assert steps["step"].tolist() == [0, 1]
    assert steps["tokens"].tolist() == [12, 12]
    assert steps["loss"].tolist() == pytest.approx(mean_losses, rel=1e-6)
    assert steps["lr"].tolist() == [0.1, 0.1]                       # the outer optimizer's group
    assert (steps[["fwd_ns", "bwd_ns", "opt_ns"]] > 0).all().all()
    assert (steps["start_ns"].iloc[1] == steps["end_ns"].iloc[0])


_DATA_SCRIPT = """
import time, torch, dtprobe
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, dataloader
from dtprobe.collectors.launch_steps import ScriptSteps

def slow_collate(items):                              # the batch's decode: 30 ms
    time.sleep(0.03)
    return dataloader.default_collate(items)

def other_batches():                                  # not a DataLoader: its 20 ms are in no phase
    while True:
        time.sleep(0.02)
        yield torch.randn(4, 8)

probe = dtprobe.attach({run!r}, devices=False)
steps = ScriptSteps(probe)
original = dataloader._BaseDataLoaderIter.__next__
steps.install()
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4, collate_fn=slow_collate)
before_ns = time.time_ns()
batches, extra = iter(loader), other_batches()
for i in range(4):                                   # 2 steps of 2 DataLoader micro-batches each
    (x,) = next(batches)
    model(x).square().mean().backward()
    if i % 2 == 1:
        opt.step()
        opt.zero_grad()
for _ in range(2):                                   # 2 steps fed by the generator
    model(next(extra)).square().mean().backward()
    opt.step()
    opt.zero_grad()
steps.close()
print(before_ns, dataloader._BaseDataLoaderIter.__next__ is original)
probe.close()
"""


def test_script_steps_time_the_dataloaders_batches_as_the_data_phase(tmp_path, run_python):
    run = tmp_path / "run"
    proc = run_python(textwrap.dedent(_DATA_SCRIPT.format(run=str(run))), timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before_ns, restored = proc.stdout.split()
    assert restored == "True"                                       # close() put DataLoader's own __next__ back
    steps = RunStore.open(run).table("steps").sort_values("step")
    assert steps["step"].tolist() == [0, 1, 2, 3]
    data_ms = (steps["data_ns"].astype("float64") / 1e6).tolist()
    assert all(60 <= ms < 90 for ms in data_ms[:2]), data_ms          # 2 batches of 30 ms each
    assert pd.isna(steps["data_ns"].iloc[2]) and pd.isna(steps["data_ns"].iloc[3])   # the generator's: none
    # step 0 starts at its first batch's fetch, not at its first forward 30 ms later
    assert 0 <= steps["start_ns"].iloc[0] - int(before_ns) < 20e6
    # the generator's sleep is in its steps, in no phase
    third = steps.iloc[2]
    assert third["end_ns"] - third["start_ns"] - third[["fwd_ns", "bwd_ns", "opt_ns"]].sum() >= 20e6
