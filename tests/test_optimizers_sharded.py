"""LAMB and LARS on sharded parameters (2 ranks, gloo): the trust ratio of a DTensor shard and of an FSDP2 parameter
is that of the whole parameter, so the sharded step equals the unsharded one. The parameters are built with rows
of very different scales, so a ratio taken over the local shard alone would give a clearly different step (the
worker measures that too, to show the comparison can fail)."""

from __future__ import annotations

import json
import subprocess

import pytest

WORKER = r'''
import json, sys, datetime
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.fsdp import fully_shard
from dtprobe.runtime.optimizers import build_optimizer

rank, port = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
mesh = init_device_mesh("cpu", (2,))
KW = {"lamb": dict(lr=0.05, weight_decay=0.1), "lars": dict(lr=2.0, momentum=0.9, weight_decay=0.01)}
# rows 0-1 are 20x larger than rows 2-3, columns 0-1 likewise: shards along either dim differ in norm
SCALE = torch.tensor([[20.0], [20.0], [1.0], [1.0]]) * torch.tensor([[20.0, 20.0, 1.0, 1.0]])

def weight():
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * SCALE

def grads():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 4, generator=g) for _ in range(2)]

def plain_steps(name, w, gs):
    p = nn.Parameter(w.clone())
    opt = build_optimizer([p], name=name, **KW[name])
    for g in gs:
        p.grad = g.clone()
        opt.step()
    return p.detach()

out = {}
for name in ("lamb", "lars"):
    reference = plain_steps(name, weight(), grads())
    for dim in (0, 1):
        p = nn.Parameter(distribute_tensor(weight(), mesh, [Shard(dim)]))
        opt = build_optimizer([p], name=name, **KW[name])
        for g in grads():
            p.grad = distribute_tensor(g, mesh, [Shard(dim)])
            opt.step()
        full = p.detach().full_tensor()
        # the same steps with a ratio over this rank's shard only, for contrast
        local = plain_steps(name, weight().chunk(2, dim)[rank], [g.chunk(2, dim)[rank] for g in grads()])
        out[f"{name}_dtensor_shard{dim}"] = {
            "max_diff": float((full - reference).abs().max()),
            "shard_only_diff": float((local - reference.chunk(2, dim)[rank]).abs().max()),
            "moved": float((reference - weight()).abs().max())}
    # FSDP2: gradients from a real backward (the same batch on both ranks, so the averaged gradient is the batch's)
    torch.manual_seed(0)
    ref_model = nn.Linear(4, 4)
    with torch.no_grad():
        ref_model.weight.copy_(weight())
    model = nn.Linear(4, 4)
    model.load_state_dict(ref_model.state_dict())
    fully_shard(model, mesh=mesh)
    ref_opt = build_optimizer(ref_model.parameters(), name=name, **KW[name])
    opt = build_optimizer(model.parameters(), name=name, **KW[name])
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    for m, o in ((ref_model, ref_opt), (model, opt)):
        for _ in range(2):
            (m(x) ** 2).mean().backward()
            o.step()
            o.zero_grad()
    out[f"{name}_fsdp2"] = {"max_diff": max(float((p.full_tensor() - r).abs().max())
                                            for p, r in zip(model.parameters(), ref_model.parameters())),
                            "moved": float((ref_model.weight.detach() - weight()).abs().max())}
if rank == 0:
    print(json.dumps(out), flush=True)
dist.barrier()
dist.destroy_process_group()
from dtprobe.runtime.quick_exit import quick_exit
quick_exit(0)                                       # no torch teardown (seconds per rank) after the work
'''


@pytest.mark.multiproc
def test_trust_ratio_of_a_sharded_parameter_equals_the_unsharded_one(start_python, free_port, child_env):
    port = str(free_port())
    procs = [start_python(WORKER, str(rank), port, env=child_env(PYTHONWARNINGS="ignore"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, "\n".join(f"rank {r}: {e[-3000:]}" for r, (_, e) in enumerate(outputs))
    results = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert set(results) == {f"{n}_{c}" for n in ("lamb", "lars")
                            for c in ("dtensor_shard0", "dtensor_shard1", "fsdp2")}
    for case, r in results.items():
        print(f"{case}: {r}")
        assert r["moved"] > 1e-2, (case, r)                  # the steps changed the weights visibly
        assert r["max_diff"] < 1e-5 * max(1.0, r["moved"]), (case, r)
        if "shard_only_diff" in r:
            assert r["shard_only_diff"] > 100 * max(r["max_diff"], 1e-6), (case, r)
