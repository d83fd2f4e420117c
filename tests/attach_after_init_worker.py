"""A torchrun worker that calls ``init_process_group("gloo")`` itself and ``dtprobe.attach`` after it, as a user's
script or a framework does; read by ``tests/test_attach_after_init.py``.

Launch: ``torchrun --nproc-per-node N tests/attach_after_init_worker.py RUN_DIR SCENARIO`` with SCENARIO one of

- ``ddp`` (2 ranks): a group made before attach (named in the warning, not recorded), then DDP on the default
  group, a functional all-reduce (resolved by group name) and a group made after attach, 3 steps;
- ``fsdp2`` (2 ranks): ``fully_shard`` on its default mesh, 3 steps;
- ``mesh2d`` (4 ranks): a 2x2 ("dp", "tp") DeviceMesh built by the script, tensor parallelism on "tp" and FSDP2 on
  "dp", 3 steps.

Writes ``RUN_DIR/warnings.rank<R>.txt`` (the attach warnings) and ``RUN_DIR/expect.rank<R>.json`` (what the
test compares the rows with: group names and the sizes the script knows).
"""

from __future__ import annotations

import datetime
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import dtprobe

STEPS = 3


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def train(model: nn.Module, probe, *, batch: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        with probe.step(step):
            loss = model(batch).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()


def main() -> None:
    run_dir, scenario = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    expect: dict = {}
    early = dist.new_group([0, 1], group_desc="made_before_attach") if scenario == "ddp" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = dtprobe.attach(run_dir, devices=False, timeout_s=60)
    run_dir.joinpath(f"warnings.rank{rank}.txt").write_text("\n".join(str(w.message) for w in caught
                                                                       if "dtprobe" in str(w.message)))
    batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))

    if scenario == "ddp":
        from torch.distributed import _functional_collectives as funcol
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(mlp())
        train(model, probe, batch=batch)
        dist.all_reduce(torch.ones(7), group=early)                    # made before attach: not recorded
        late = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(5), group=late)                     # made after attach: recorded
        funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD).wait()   # functional: resolved by name
        expect = {"grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "late_pg": f"g{late.group_name}", "early_name": early.group_name}
    elif scenario == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = mlp()
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        train(model, probe, batch=batch)
        expect = {"param_bytes": sum(p.numel() * 4 for p in mlp().parameters())}
    elif scenario == "mesh2d":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = mlp()
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(mesh.get_local_rank("dp")))
        train(model, probe, batch=batch)
        expect = {"dp_ranks": dist.get_process_group_ranks(mesh.get_group("dp")),
                  "tp_ranks": dist.get_process_group_ranks(mesh.get_group("tp"))}
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    run_dir.joinpath(f"expect.rank{rank}.json").write_text(json.dumps(expect))
    probe.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The rows are closed and the groups destroyed: end without torch's teardown (seconds per rank), as
    # ``dtprobe run``'s worker does.
    from dtprobe.runtime.quick_exit import quick_exit
    quick_exit(0)
