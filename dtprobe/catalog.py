"""Presets and hardware as data: model shapes, dense peak FLOP/s by GPU and dtype, device memory and links.

Read by the runtime (the sizes of its built-in GPT), the analysis (MFU: a GPU's peak looked up by the device
name a run recorded; FLOPs per token of a built-in model) and the planner (its model and device presets). A
leaf: it imports nothing from dtprobe and no torch, so every package may use it and parsing a job stays cheap.

GPU figures are the vendors' dense (no 2:4 sparsity) datasheet values. The ``cpu`` device's figures are
declared CPU figures, never a GPU's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

GB = 1e9
"""Bytes per GB (datasheets quote decimal GB/s)."""

_Entry = TypeVar("_Entry")


class UnknownNameError(LookupError):
    """A name that is not in a catalog table; the message names the key it came from and lists the known names."""


def lookup(table: Mapping[str, _Entry], name: str, *, key: str) -> _Entry:
    """``table[name]``; UnknownNameError naming ``key`` (the flag or config key that gave ``name``) otherwise."""
    if name not in table:
        raise UnknownNameError(f"{key} '{name}' is not a preset; choose one of {', '.join(table)}")
    return table[name]


# ------------------------------------------------------------------------------------------------------ models


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """A GPT-like decoder-only transformer: its sizes and the parameter and FLOP counts they imply."""

    num_layers: int
    """Transformer blocks ``L``."""
    hidden: int
    """Model width ``h``."""
    num_heads: int
    """Attention heads ``a``."""
    ffn_hidden: int
    """MLP inner width ``f``."""
    vocab_size: int
    """Vocabulary ``V``."""
    seq_len: int
    """Longest training sequence ``s`` (the built-in GPT's position-embedding length; the planner's default)."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means ``num_heads``."""
    gated_mlp: bool = False
    """SwiGLU MLP (three ``h x f`` matrices) instead of GELU (two)."""
    tied_embeddings: bool = False
    """Output head shares the input embedding's weights."""
    learned_positions: bool = False
    """A learned ``seq_len x h`` position embedding (GPT-2/3) instead of rotary."""
    fused_qkv: bool = True
    """One QKV projection (Megatron). Separate q/k/v column-parallel linears (dtprobe's built-in GPT under
    DTensor TP) each all-reduce their input gradient: 2 more TP all-reduces per layer in backward."""

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used."""
        return self.num_kv_heads or self.num_heads

    @property
    def params_per_layer(self) -> int:
        """Weights of one block: q, k, v, o, the MLP matrices and two norms (biases ignored)."""
        h, f = self.hidden, self.ffn_hidden
        kv = h * self.kv_heads // self.num_heads
        return 2 * h * h + 2 * h * kv + (3 if self.gated_mlp else 2) * h * f + 2 * h

    @property
    def embedding_params(self) -> int:
        """Input embedding (and learned positions): held by the first pipeline stage."""
        return self.vocab_size * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    @property
    def head_params(self) -> int:
        """Final norm and output head (0 extra when tied): held by the last pipeline stage."""
        return self.hidden + (0 if self.tied_embeddings else self.vocab_size * self.hidden)

    @property
    def num_params(self) -> int:
        """All weights (biases ignored)."""
        return self.num_layers * self.params_per_layer + self.embedding_params + self.head_params

    def matmul_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token: 2 x every weight matmul + attention scores (QK^T and AV, 4 s h per layer)."""
        dense = self.num_layers * (self.params_per_layer - 2 * self.hidden) + self.vocab_size * self.hidden
        return 2.0 * dense + 4.0 * self.num_layers * seq_len * self.hidden

    def training_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs per token: 3 x the forward (backward computes two matmuls per forward one)."""
        return 3.0 * self.matmul_flops_per_token(seq_len)


_BUILTIN = dict(learned_positions=True, fused_qkv=False)   # GELU MLP, learned positions, untied head, q/k/v apart
BUILTIN_MODELS: dict[str, ModelShape] = {
    "tiny": ModelShape(num_layers=4, hidden=128, num_heads=4, ffn_hidden=512, vocab_size=256, seq_len=256,
                       **_BUILTIN),
    "small": ModelShape(num_layers=8, hidden=256, num_heads=8, ffn_hidden=1024, vocab_size=256, seq_len=512,
                        **_BUILTIN),
    "medium": ModelShape(num_layers=12, hidden=512, num_heads=8, ffn_hidden=2048, vocab_size=256, seq_len=1024,
                         **_BUILTIN),
}
"""dtprobe's own GPT sizes, trained by ``dtprobe run --model``. ``tiny`` is what tests and the demo train on a CPU."""

PUBLISHED_MODELS: dict[str, ModelShape] = {
    # Meta Llama 3 model card / params.json: GQA with 8 KV heads, SwiGLU, vocab 128256, untied head
    "llama3-8b": ModelShape(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, ffn_hidden=14336,
                            vocab_size=128256, seq_len=8192, gated_mlp=True),
    "llama3-70b": ModelShape(num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8, ffn_hidden=28672,
                             vocab_size=128256, seq_len=8192, gated_mlp=True),
    # Brown et al. 2020 (GPT-3 paper, Table 2.1): 96 layers, d_model 12288, 96 heads, context 2048
    "gpt3-175b": ModelShape(num_layers=96, hidden=12288, num_heads=96, ffn_hidden=4 * 12288, vocab_size=50257,
                            seq_len=2048, tied_embeddings=True, learned_positions=True),
}
"""Published models the planner sizes (dtprobe does not train them)."""

MODEL_SHAPES: dict[str, ModelShape] = {**BUILTIN_MODELS, **PUBLISHED_MODELS}
"""Every model preset by name: the built-in GPT sizes first."""


# ---------------------------------------------------------------------------------------------------- hardware


@dataclass(kw_only=True, frozen=True)
class GpuModel:
    """One GPU model's dense datasheet peaks and how to recognise it by the name its driver reports."""

    pattern: str
    """Regex searched in the lower-cased device name (``torch.cuda.get_device_name``, ``nvidia-smi``)."""
    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s per device by compute dtype (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``); a missing
    dtype has no peak in this table."""


GPU_MODELS: dict[str, GpuModel] = {
    # NVIDIA H100 (SXM): BF16/FP16 989 TFLOPS dense (1,979 with sparsity), FP8 1,979 dense, TF32 494, FP32 67
    "h100-sxm": GpuModel(pattern=r"h100.*(sxm|hbm3)|h100$|h100 80gb hbm3",
                         peak_flops={"fp32": 67e12, "tf32": 494e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12}),
    "h100-pcie": GpuModel(pattern=r"h100.*pcie",
                          peak_flops={"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12}),
    # GH200 before H200: "gh200" also contains "h200"; the first matching pattern wins
    "gh200": GpuModel(pattern=r"gh200", peak_flops={"fp32": 67e12, "tf32": 494e12, "bf16": 989e12, "fp16": 989e12}),
    # NVIDIA H200 (SXM): the compute of an H100 SXM
    "h200": GpuModel(pattern=r"h200",
                     peak_flops={"fp32": 67e12, "tf32": 494e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12}),
    "b200": GpuModel(pattern=r"b200", peak_flops={"fp32": 80e12, "tf32": 1100e12, "bf16": 2250e12, "fp16": 2250e12}),
    # NVIDIA A100 Tensor Core GPU (SXM and PCIe): TF32 156, BF16/FP16 312 TFLOPS dense; FP32 19.5
    "a100": GpuModel(pattern=r"a100", peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}),
    "a800": GpuModel(pattern=r"a800", peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}),
    "a10g": GpuModel(pattern=r"a10g", peak_flops={"fp32": 31.2e12, "tf32": 35e12, "bf16": 70e12, "fp16": 70e12}),
    "a10": GpuModel(pattern=r"\ba10\b", peak_flops={"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12}),
    "l40s": GpuModel(pattern=r"l40s", peak_flops={"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12}),
    "l4": GpuModel(pattern=r"\bl4\b", peak_flops={"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12}),
    "v100": GpuModel(pattern=r"v100", peak_flops={"fp32": 15.7e12, "fp16": 125e12}),
    "t4": GpuModel(pattern=r"t4", peak_flops={"fp32": 8.1e12, "fp16": 65e12}),
    # AMD Instinct MI300X: BF16/FP16 1,307.4 TFLOPS dense, FP8 2,614.9, TF32 654, FP32 (matrix) 163.4
    "mi300x": GpuModel(pattern=r"mi300x",
                       peak_flops={"fp32": 163.4e12, "tf32": 654e12, "bf16": 1307.4e12, "fp16": 1307.4e12,
                                   "fp8": 2614.9e12}),
    "mi250": GpuModel(pattern=r"mi250", peak_flops={"fp32": 47.9e12, "bf16": 383e12, "fp16": 383e12}),
}
"""GPU models by key, in match order (a more specific pattern before a more general one)."""


def match_gpu(device_name: str) -> str | None:
    """The ``GPU_MODELS`` key of the first model whose pattern is found in ``device_name`` (any case), or None."""
    name = device_name.lower()
    return next((key for key, gpu in GPU_MODELS.items() if re.search(gpu.pattern, name)), None)


@dataclass(kw_only=True, frozen=True)
class Device:
    """A device as the planner models it: compute peaks, memory, and its links inside and across nodes."""

    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s by precision; a missing key = unsupported."""
    memory_gib: float
    """Device memory in GiB (as the driver reports it)."""
    mem_bw_bytes_per_s: float
    """Memory bandwidth, for the optimizer step."""
    intra_bw_bytes_per_s: float
    """Per-device, per-direction bandwidth to peers in the same node (NVLink / xGMI)."""
    inter_bw_bytes_per_s: float
    """Per-device, per-direction network bandwidth across nodes (one NIC per device)."""
    intra_latency_s: float = 5e-6
    """Per-hop latency (alpha) inside a node."""
    inter_latency_s: float = 10e-6
    """Per-hop latency (alpha) across nodes."""
    is_cpu: bool = False
    """True for the ``cpu`` device: its figures are CPU figures, reported as such, never as a GPU's."""


DEVICES: dict[str, Device] = {
    # A100 40GB HBM2 1,555 GB/s, 80GB HBM2e 2,039 GB/s; NVLink 600 GB/s total = 300 GB/s per direction.
    # Network: DGX A100 has 8x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU.
    "a100-40": Device(peak_flops=GPU_MODELS["a100"].peak_flops, memory_gib=40.0, mem_bw_bytes_per_s=1555 * GB,
                      intra_bw_bytes_per_s=300 * GB, inter_bw_bytes_per_s=25 * GB),
    "a100-80": Device(peak_flops=GPU_MODELS["a100"].peak_flops, memory_gib=80.0, mem_bw_bytes_per_s=2039 * GB,
                      intra_bw_bytes_per_s=300 * GB, inter_bw_bytes_per_s=25 * GB),
    # H100 SXM 80GB HBM3 3.35 TB/s; NVLink 900 GB/s total = 450 per direction. DGX H100: 8x 400 Gb/s NDR = 50 GB/s/GPU.
    "h100-80": Device(peak_flops=GPU_MODELS["h100-sxm"].peak_flops, memory_gib=79.6, mem_bw_bytes_per_s=3350 * GB,
                      intra_bw_bytes_per_s=450 * GB, inter_bw_bytes_per_s=50 * GB),
    # H200 SXM: 141GB HBM3e 4.8 TB/s; NVLink 900 GB/s.
    "h200": Device(peak_flops=GPU_MODELS["h200"].peak_flops, memory_gib=140.4, mem_bw_bytes_per_s=4800 * GB,
                   intra_bw_bytes_per_s=450 * GB, inter_bw_bytes_per_s=50 * GB),
    # MI300X: 192GB HBM3 5.3 TB/s; Infinity Fabric 896 GB/s aggregate peer bandwidth = 448 per direction; 400 Gb/s NICs.
    "mi300x": Device(peak_flops=GPU_MODELS["mi300x"].peak_flops, memory_gib=192.0, mem_bw_bytes_per_s=5300 * GB,
                     intra_bw_bytes_per_s=448 * GB, inter_bw_bytes_per_s=50 * GB),
    # A CPU process (the CI / laptop runs, gloo over loopback). Declared CPU figures, not a GPU's: about 50 GFLOP/s
    # fp32 for one AVX2 core, host DRAM, loopback TCP. Calibrate with `dtprobe plan --calibrate RUN`.
    "cpu": Device(peak_flops={"fp32": 50e9, "bf16": 50e9, "fp16": 50e9}, memory_gib=8.0, mem_bw_bytes_per_s=10 * GB,
                  intra_bw_bytes_per_s=2 * GB, inter_bw_bytes_per_s=1 * GB, intra_latency_s=50e-6,
                  inter_latency_s=100e-6, is_cpu=True),
}
"""Planner devices by name (``dtprobe plan --gpu``); the GPUs' peaks are their ``GPU_MODELS`` entries."""


__all__ = ["BUILTIN_MODELS", "DEVICES", "GB", "GPU_MODELS", "MODEL_SHAPES", "PUBLISHED_MODELS", "Device",
           "GpuModel", "ModelShape", "UnknownNameError", "lookup", "match_gpu"]
