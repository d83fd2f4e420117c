"""Model, device, cluster and training specs; read by the planner's memory and time models.

The presets are ``dtprobe.catalog``'s model shapes and devices, wrapped here with a name and the checks a
user-built spec needs. Peak FLOP/s, memory and links are data, looked up by device and precision, never
written into a formula.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TypeVar

from dtprobe.catalog import DEVICES, GB, MODEL_SHAPES, Device, ModelShape, UnknownNameError, lookup
from dtprobe.store.errors import ConfigError

GIB = 1024**3
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
OPTIMIZERS = ("adam", "sgd")


@dataclass(kw_only=True, frozen=True)
class ModelSpec(ModelShape):
    """A GPT-like decoder-only transformer with a name: a catalog preset or the user's own shape."""

    name: str
    """Preset or user name, shown in reports."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden", "num_heads", "ffn_hidden", "vocab_size", "seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} = {getattr(self, key)} must be >= 1")
        if self.hidden % self.num_heads:
            raise ConfigError(f"model.hidden ({self.hidden}) must be divisible by model.num_heads "
                              f"({self.num_heads})")
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads "
                              f"({self.num_kv_heads})")


MODEL_PRESETS: dict[str, ModelSpec] = {name: ModelSpec(name=name, **asdict(shape))
                                       for name, shape in MODEL_SHAPES.items()}
"""Model presets by name (``--model``): the built-in GPT sizes, LLaMA-3 8B / 70B and GPT-3 175B."""


@dataclass(kw_only=True, frozen=True)
class DeviceSpec(Device):
    """One accelerator (or a CPU process standing in for one), named."""

    name: str
    """Preset name."""

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s at ``precision``; ConfigError when the device has none."""
        if precision not in self.peak_flops:
            raise ConfigError(f"device '{self.name}' has no {precision} peak (it supports "
                              f"{', '.join(sorted(self.peak_flops))}); pick --precision from those")
        return self.peak_flops[precision]


GPU_PRESETS: dict[str, DeviceSpec] = {
    name: DeviceSpec(name=name, **{**asdict(device),
                                   "peak_flops": {p: f for p, f in device.peak_flops.items() if p in PRECISIONS}})
    for name, device in DEVICES.items()}
"""Device presets by name (``--gpu``), with the peaks of the precisions the planner models."""

_Preset = TypeVar("_Preset")


def _preset(table: dict[str, _Preset], name: str, *, key: str) -> _Preset:
    try:
        return lookup(table, name, key=key)
    except UnknownNameError as exc:
        raise ConfigError(str(exc)) from None


def device_preset(name: str) -> DeviceSpec:
    """A device preset by name; ConfigError naming ``--gpu`` and listing the presets otherwise."""
    return _preset(GPU_PRESETS, name, key="--gpu")


@dataclass(kw_only=True, frozen=True)
class ClusterSpec:
    """Nodes of identical devices."""

    device: DeviceSpec
    """The device every rank uses."""
    num_nodes: int
    """Nodes."""
    gpus_per_node: int
    """Devices per node (the NVLink / xGMI domain)."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"cluster needs >= 1 node and >= 1 GPU per node; got {self.num_nodes} nodes x "
                              f"{self.gpus_per_node} GPUs")

    @property
    def world_size(self) -> int:
        """Total devices."""
        return self.num_nodes * self.gpus_per_node


def make_cluster(*, gpu: str, num_gpus: int, gpus_per_node: int, intra_bw_gb_s: float | None = None,
                 inter_bw_gb_s: float | None = None, intra_latency_us: float | None = None,
                 inter_latency_us: float | None = None, memory_gib: float | None = None) -> ClusterSpec:
    """A cluster from a device preset name and a GPU count, with optional link/memory overrides."""
    device = device_preset(gpu)
    if gpus_per_node < 1 or num_gpus < 1 or num_gpus % gpus_per_node:
        raise ConfigError(f"--gpus ({num_gpus}) must be a positive multiple of --gpus-per-node ({gpus_per_node})")
    overrides = {"intra_bw_bytes_per_s": intra_bw_gb_s and intra_bw_gb_s * GB,
                 "inter_bw_bytes_per_s": inter_bw_gb_s and inter_bw_gb_s * GB,
                 "intra_latency_s": intra_latency_us and intra_latency_us * 1e-6,
                 "inter_latency_s": inter_latency_us and inter_latency_us * 1e-6, "memory_gib": memory_gib}
    device = replace(device, **{k: v for k, v in overrides.items() if v})
    return ClusterSpec(device=device, num_nodes=num_gpus // gpus_per_node, gpus_per_node=gpus_per_node)


@dataclass(kw_only=True, frozen=True)
class TrainingSpec:
    """What one optimizer step processes and how."""

    global_batch: int
    """Sequences per optimizer step, over all data-parallel replicas."""
    seq_len: int
    """Tokens per sequence."""
    precision: str = "bf16"
    """Compute precision: fp32, or bf16 / fp16 / fp8 mixed precision with fp32 master weights."""
    optimizer: str = "adam"
    """adam (two fp32 moments) or sgd (one fp32 momentum)."""
    memory_margin_frac: float = 0.10
    """Share of device memory kept free (allocator fragmentation, CUDA context, workspaces)."""
    sequence_parallel: bool = True
    """Use sequence parallelism with TP (Megatron SP): layer-norm/dropout activations sharded by TP."""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1:
            raise ConfigError(f"training.global_batch ({self.global_batch}) and training.seq_len ({self.seq_len}) "
                              f"must be >= 1")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision '{self.precision}' is unknown; use one of {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"training.optimizer '{self.optimizer}' is unknown; use one of {', '.join(OPTIMIZERS)}")
        if not 0 <= self.memory_margin_frac < 1:
            raise ConfigError(f"training.memory_margin_frac ({self.memory_margin_frac}) must be in [0, 1)")

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter held for compute (fp32 = 4; 16-bit and fp8 training keep 16-bit weights)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element (same as the compute weights)."""
        return self.param_bytes

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer state bytes per parameter: fp32 moments, plus an fp32 master copy in mixed precision."""
        moments = 8 if self.optimizer == "adam" else 4
        return moments + (0 if self.precision == "fp32" else 4)

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element (Korthikanti et al. assume 2: 16-bit)."""
        return 4 if self.precision == "fp32" else 2


def model_preset(name: str) -> ModelSpec:
    """A model preset by name; ConfigError naming ``--model`` and listing the presets otherwise."""
    return _preset(MODEL_PRESETS, name, key="--model")


__all__ = ["GIB", "GPU_PRESETS", "MODEL_PRESETS", "ClusterSpec", "DeviceSpec", "ModelSpec", "TrainingSpec",
           "device_preset", "make_cluster", "model_preset"]
