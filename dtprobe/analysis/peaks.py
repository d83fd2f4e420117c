"""Peak dense FLOP/s by device model and dtype, and model FLOPs per token of the built-in presets; read by
``throughput`` (MFU). Vendor datasheet numbers, dense (no 2:4 sparsity). A CPU has no declared peak."""

from __future__ import annotations

import re

PEAK_FLOPS: dict[str, dict[str, float]] = {
    # name pattern (lower case, regex) -> dtype -> FLOP/s per device
    r"h100.*(sxm|hbm3)|h100$|h100 80gb hbm3": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    r"h100.*pcie": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    r"h200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    r"gh200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    r"b200": {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 80e12},
    r"a100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    r"a800": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    r"a10g": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
    r"\ba10\b": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    r"l40s": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    r"\bl4\b": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    r"v100": {"fp16": 125e12, "fp32": 15.7e12},
    r"t4": {"fp16": 65e12, "fp32": 8.1e12},
    r"mi300x": {"bf16": 1307e12, "fp16": 1307e12, "tf32": 654e12, "fp32": 163e12},
    r"mi250": {"bf16": 383e12, "fp16": 383e12, "fp32": 47.9e12},
}
"""Peak dense FLOP/s per device model (regex on the lower-cased device name) and compute dtype."""

# Shapes of dtprobe.runtime.model.PRESETS, duplicated so analysis does not import torch (keep in sync).
PRESET_SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"num_layers": 4, "hidden": 128, "ffn_hidden": 512, "vocab_size": 256},
    "small": {"num_layers": 8, "hidden": 256, "ffn_hidden": 1024, "vocab_size": 256},
    "medium": {"num_layers": 12, "hidden": 512, "ffn_hidden": 2048, "vocab_size": 256},
}


def flops_per_token(*, num_layers: int, hidden: int, ffn_hidden: int, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token (3x forward: matmuls, attention scores, head), as ``GPTConfig.flops_per_token``."""
    h, f, n = hidden, ffn_hidden, num_layers
    forward = 2 * n * (4 * h * h + 2 * h * f) + 2 * n * 2 * seq_len * h + 2 * h * vocab_size
    return 3.0 * forward


def preset_flops_per_token(name: str, seq_len: int) -> float | None:
    """FLOPs per token of a built-in preset, None for an unknown name."""
    shape = PRESET_SHAPES.get(name)
    return flops_per_token(seq_len=seq_len, **shape) if shape else None


def normalize_dtype(dtype: str | None) -> str:
    """``bfloat16``/``bf16`` -> bf16, ``float16``/``fp16``/``half`` -> fp16, ``tf32`` -> tf32, else fp32."""
    d = (dtype or "fp32").lower()
    if "bf16" in d or "bfloat16" in d:
        return "bf16"
    if "fp16" in d or "float16" in d or d == "half":
        return "fp16"
    if "tf32" in d:
        return "tf32"
    return "fp32"


def peak_flops(device_name: str | None, dtype: str | None) -> tuple[float | None, str]:
    """(peak FLOP/s, why): the peak of ``device_name`` for ``dtype``, or None and the reason (CPU, unknown model,
    no such dtype on it). Never a guess."""
    if not device_name:
        return None, "device model unknown (no device name recorded)"
    name = device_name.lower()
    if name.startswith("cpu") or name == "cpu":
        return None, "CPU: no declared peak FLOP/s, MFU is not defined"
    dt = normalize_dtype(dtype)
    for pattern, peaks in PEAK_FLOPS.items():
        if re.search(pattern, name):
            if dt in peaks:
                return peaks[dt], f"{device_name} {dt} datasheet peak (dense)"
            return None, f"{device_name} has no {dt} peak in dtprobe's table"
    return None, f"device '{device_name}' is not in dtprobe's peak table (dtprobe.analysis.peaks.PEAK_FLOPS)"
