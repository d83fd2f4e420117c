"""``NullProbe``: the probe of ``attach(enabled=False)``; every call is a no-op (overhead baselines)."""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from dtprobe.collectors.config import CollectConfig
from dtprobe.collectors.training import NullStepContext
from dtprobe.store.writer import NullWriter


class NullProbe:
    """Same surface as ``dtprobe.collectors.attach.Probe``; records nothing, creates plain (unrecorded) groups."""

    def __init__(self, run_dir: Any = None, *, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 device: str = "cpu", config: CollectConfig | None = None) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.config = config or CollectConfig(enabled=False)
        self.writer = NullWriter()
        self.clock_offset_ns = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def current_step(self) -> int:
        return -1

    def step(self, step: int) -> NullStepContext:
        return NullStepContext(step)

    def hook_step(self, step: int) -> NullStepContext:
        return NullStepContext(step)

    def stop_step_hooks(self) -> None:
        pass

    def fault(self, kind: str, *, step: Any = None, injected: bool = False, **detail: Any) -> None:
        pass

    def record(self, table: str, row: dict[str, Any]) -> None:
        pass

    def discard_step(self, ctx: Any) -> None:
        pass

    def new_group(self, ranks: Sequence[int] | None = None, *, name: str, **kwargs: Any) -> Any:
        return dist.new_group(list(ranks) if ranks is not None else None, **kwargs)

    def name_group(self, group: Any, name: str) -> None:
        pass

    def init_device_mesh(self, device_type: str, mesh_shape: Sequence[int], *,
                         mesh_dim_names: Sequence[str] | None = None) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(mesh_shape),
                                mesh_dim_names=tuple(mesh_dim_names) if mesh_dim_names else None)

    def name_mesh(self, mesh: Any) -> None:
        pass

    def pending_collectives(self) -> list[dict[str, Any]]:
        return []

    def flush(self, *, in_flight: bool = False) -> None:
        pass

    def close(self, status: str = "finished", *, reason: str | None = None) -> None:
        pass

    def __enter__(self) -> "NullProbe":
        return self

    def __exit__(self, *exc: object) -> None:
        pass
