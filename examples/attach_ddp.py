"""The README's `dtprobe.attach` example, runnable: a plain DDP script with dtprobe telemetry.

    torchrun --standalone --nproc-per-node 2 examples/attach_ddp.py runs/attach-demo
"""
import sys

import torch

import dtprobe
from dtprobe.runtime.model import build_model, lm_loss

probe = dtprobe.attach(sys.argv[1] if len(sys.argv) > 1 else "runs/attach-demo", profile_steps=(3, 4))
model = torch.nn.parallel.DistributedDataParallel(build_model("tiny", seed=0))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(probe.rank)
for step in range(8):
    with probe.step(step) as s:
        with s.phase("data"):
            batch = torch.randint(0, 256, (4, 33), generator=gen)
        with s.phase("fwd"):
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        with s.phase("bwd"):
            loss.backward()
        with s.phase("opt"):
            opt.step()
            opt.zero_grad()
        s.record(loss=loss.item(), tokens=batch[:, 1:].numel())
probe.close()
torch.distributed.destroy_process_group()   # as torch asks: a live gloo group can abort the exit
