"""Model, device, cluster and training specs with presets; read by the planner's memory and time models.

Peak FLOP/s, memory and links are data (``GPU_PRESETS``), looked up by device and precision, never
written into a formula. GPU figures are the vendors' dense (no sparsity) datasheet values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtprobe.store.errors import ConfigError

GIB = 1024**3
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
OPTIMIZERS = ("adam", "sgd")


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """A GPT-like decoder-only transformer."""

    name: str
    """Preset or user name, shown in reports."""
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
    """Default training sequence length ``s``."""
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
        """All parameters."""
        return self.num_layers * self.params_per_layer + self.embedding_params + self.head_params

    def matmul_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token: 2 x every weight matmul + attention scores (QK^T and AV, 4 s h per layer)."""
        dense = self.num_layers * (self.params_per_layer - 2 * self.hidden) + self.vocab_size * self.hidden
        return 2.0 * dense + 4.0 * self.num_layers * seq_len * self.hidden


def _model(name: str, **kw) -> ModelSpec:
    return ModelSpec(name=name, **kw)


MODEL_PRESETS: dict[str, ModelSpec] = {
    # dtprobe's built-in GPT sizes (dtprobe/runtime/model.py PRESETS): GELU MLP, learned positions, untied head
    "tiny": _model("tiny", num_layers=4, hidden=128, num_heads=4, ffn_hidden=512, vocab_size=256, seq_len=256,
                   learned_positions=True, fused_qkv=False),
    "small": _model("small", num_layers=8, hidden=256, num_heads=8, ffn_hidden=1024, vocab_size=256,
                    seq_len=512, learned_positions=True, fused_qkv=False),
    "medium": _model("medium", num_layers=12, hidden=512, num_heads=8, ffn_hidden=2048, vocab_size=256,
                     seq_len=1024, learned_positions=True, fused_qkv=False),
    # Meta Llama 3 model card / params.json: GQA with 8 KV heads, SwiGLU, vocab 128256, untied head
    "llama3-8b": _model("llama3-8b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, ffn_hidden=14336,
                        vocab_size=128256, seq_len=8192, gated_mlp=True),
    "llama3-70b": _model("llama3-70b", num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8,
                         ffn_hidden=28672, vocab_size=128256, seq_len=8192, gated_mlp=True),
    # Brown et al. 2020 (GPT-3 paper, Table 2.1): 96 layers, d_model 12288, 96 heads, context 2048
    "gpt3-175b": _model("gpt3-175b", num_layers=96, hidden=12288, num_heads=96, ffn_hidden=4 * 12288,
                        vocab_size=50257, seq_len=2048, tied_embeddings=True, learned_positions=True),
}
"""Model presets by name: the built-in GPT sizes, LLaMA-3 8B / 70B and GPT-3 175B."""


@dataclass(kw_only=True, frozen=True)
class DeviceSpec:
    """One accelerator (or a CPU process standing in for one)."""

    name: str
    """Preset name."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by precision (``fp32``, ``bf16``, ``fp16``, ``fp8``); a missing key = unsupported."""
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
    """True for the ``cpu`` preset: its figures are CPU figures, reported as such, never as a GPU's."""

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s at ``precision``; ConfigError when the device has none."""
        if precision not in self.peak_flops:
            raise ConfigError(f"device '{self.name}' has no {precision} peak (it supports "
                              f"{', '.join(sorted(self.peak_flops))}); pick --precision from those")
        return self.peak_flops[precision]


T = 1e12
GB = 1e9
GPU_PRESETS: dict[str, DeviceSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): TF32 156, BF16/FP16 312 TFLOPS dense; FP32 19.5;
    # 40GB HBM2 1,555 GB/s, 80GB HBM2e 2,039 GB/s; NVLink 600 GB/s total = 300 GB/s per direction.
    # Network: DGX A100 has 8x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU.
    "a100-40": DeviceSpec(name="a100-40", peak_flops={"fp32": 19.5 * T, "bf16": 312 * T, "fp16": 312 * T},
                          memory_gib=40.0, mem_bw_bytes_per_s=1555 * GB, intra_bw_bytes_per_s=300 * GB,
                          inter_bw_bytes_per_s=25 * GB),
    "a100-80": DeviceSpec(name="a100-80", peak_flops={"fp32": 19.5 * T, "bf16": 312 * T, "fp16": 312 * T},
                          memory_gib=80.0, mem_bw_bytes_per_s=2039 * GB, intra_bw_bytes_per_s=300 * GB,
                          inter_bw_bytes_per_s=25 * GB),
    # NVIDIA H100 datasheet (SXM): BF16/FP16 989 TFLOPS dense (1,979 with sparsity), FP8 1,979 dense, FP32 67;
    # 80GB HBM3 3.35 TB/s; NVLink 900 GB/s total = 450 per direction. DGX H100: 8x 400 Gb/s NDR = 50 GB/s/GPU.
    "h100-80": DeviceSpec(name="h100-80",
                          peak_flops={"fp32": 67 * T, "bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T},
                          memory_gib=79.6, mem_bw_bytes_per_s=3350 * GB, intra_bw_bytes_per_s=450 * GB,
                          inter_bw_bytes_per_s=50 * GB),
    # NVIDIA H200 datasheet (SXM): same compute as H100 SXM; 141GB HBM3e 4.8 TB/s; NVLink 900 GB/s.
    "h200": DeviceSpec(name="h200", peak_flops={"fp32": 67 * T, "bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T},
                       memory_gib=140.4, mem_bw_bytes_per_s=4800 * GB, intra_bw_bytes_per_s=450 * GB,
                       inter_bw_bytes_per_s=50 * GB),
    # AMD Instinct MI300X datasheet: BF16/FP16 1,307.4 TFLOPS dense, FP8 2,614.9, FP32 (matrix) 163.4;
    # 192GB HBM3 5.3 TB/s; Infinity Fabric 896 GB/s aggregate peer bandwidth = 448 per direction; 400 Gb/s NICs.
    "mi300x": DeviceSpec(name="mi300x",
                         peak_flops={"fp32": 163.4 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T, "fp8": 2614.9 * T},
                         memory_gib=192.0, mem_bw_bytes_per_s=5300 * GB, intra_bw_bytes_per_s=448 * GB,
                         inter_bw_bytes_per_s=50 * GB),
    # A CPU process (the CI / laptop runs, gloo over loopback). DECLARED CPU figures, not a GPU's: ~50 GFLOP/s
    # fp32 for one AVX2 core, host DRAM, loopback TCP. Calibrate with `dtprobe plan --calibrate RUN`.
    "cpu": DeviceSpec(name="cpu", peak_flops={"fp32": 50e9, "bf16": 50e9, "fp16": 50e9}, memory_gib=8.0,
                      mem_bw_bytes_per_s=10 * GB, intra_bw_bytes_per_s=2 * GB, inter_bw_bytes_per_s=1 * GB,
                      intra_latency_s=50e-6, inter_latency_s=100e-6, is_cpu=True),
}
"""Device presets by name (``--gpu``)."""


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
    if gpu not in GPU_PRESETS:
        raise ConfigError(f"--gpu '{gpu}' is not a preset; choose one of {', '.join(GPU_PRESETS)}")
    if gpus_per_node < 1 or num_gpus < 1 or num_gpus % gpus_per_node:
        raise ConfigError(f"--gpus ({num_gpus}) must be a positive multiple of --gpus-per-node ({gpus_per_node})")
    device = GPU_PRESETS[gpu]
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
    """A model preset by name; ConfigError listing the presets otherwise."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"--model '{name}' is not a preset; choose one of {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


__all__ = ["GIB", "GPU_PRESETS", "MODEL_PRESETS", "ClusterSpec", "DeviceSpec", "ModelSpec", "TrainingSpec",
           "make_cluster", "model_preset"]
