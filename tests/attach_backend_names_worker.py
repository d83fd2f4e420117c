"""A torchrun worker that asks ``dist.get_backend`` of every kind of group while ``dtprobe.attach`` records them, as
Lightning, Accelerate or DeepSpeed do before choosing a code path; read by ``tests/test_attach_backend_names.py``.

Launch: ``torchrun --nproc-per-node 2 tests/attach_backend_names_worker.py RUN_DIR SCENARIO`` with SCENARIO one of

- ``before_init``: ``dtprobe.attach`` initializes torch.distributed itself;
- ``after_init``: the script's own ``init_process_group("gloo")``, then ``dtprobe.attach``;
- ``named_recording_backend``: the script names ``dtprobe_gloo`` in its own ``init_process_group``, then attaches;
- ``no_backend``: the script's own ``init_process_group()`` without a backend (torch registers "undefined" and
  picks gloo for the CPU), then ``dtprobe.attach``.

Then, in each: one DDP step on the default group, then one all-reduce of a size of its own on the default group (3
floats), a ``dist.new_group`` (5), a ``probe.new_group(name="ckpt")`` (6), and the two axes of a ("dp", "tp") =
(2, 1) DeviceMesh built with torch's ``init_device_mesh`` (dp spans both ranks: the default group, 9; tp is this
rank alone, 7). Writes ``RUN_DIR/expect.rank<R>.json``: the backend name of each group, the names the rows should
carry, and the gradient bytes of the DDP step.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import dtprobe
from dtprobe.collectors import register_backends

TIMEOUT = datetime.timedelta(seconds=60)


def main() -> None:
    run_dir, scenario = Path(sys.argv[1]), sys.argv[2]
    if scenario == "after_init":
        dist.init_process_group("gloo", timeout=TIMEOUT)
    elif scenario == "named_recording_backend":
        register_backends()
        dist.init_process_group("dtprobe_gloo", timeout=TIMEOUT)
    elif scenario == "no_backend":
        dist.init_process_group(timeout=TIMEOUT)
    elif scenario != "before_init":
        raise SystemExit(f"unknown scenario {scenario!r}")
    probe = dtprobe.attach(run_dir, devices=False, timeout_s=60)
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    with probe.step(0):
        model(torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()

    from torch.distributed.device_mesh import init_device_mesh

    sub = dist.new_group([0, 1])
    ckpt = probe.new_group([0, 1], name="ckpt")
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    for size, group in ((3, None), (5, sub), (6, ckpt), (9, mesh.get_group("dp")), (7, mesh.get_group("tp"))):
        dist.all_reduce(torch.ones(size), group=group)

    expect = {
        "backend": {"default": dist.get_backend(), "new_group": dist.get_backend(sub),
                    "probe_new_group": dist.get_backend(ckpt), "mesh_dp": dist.get_backend(mesh.get_group("dp")),
                    "mesh_tp": dist.get_backend(mesh.get_group("tp")), "world": dist.get_backend(dist.group.WORLD)},
        "sub_pg": f"g{sub.group_name}",
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
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
