"""A run's peak dense FLOP/s (by recorded device name and dtype) and FLOPs per token of a built-in model; read by
``throughput`` (MFU) through the facade. The figures are ``dtprobe.catalog``'s; a CPU has no declared peak."""

from __future__ import annotations

from dtprobe.catalog import BUILTIN_MODELS, GPU_MODELS, match_gpu


def preset_flops_per_token(name: str, seq_len: int) -> float | None:
    """Training FLOPs per token of a built-in model at ``seq_len``, None for a name that is not one."""
    shape = BUILTIN_MODELS.get(name)
    return shape.training_flops_per_token(seq_len) if shape else None


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
    if device_name.lower().startswith("cpu"):
        return None, "CPU: no declared peak FLOP/s, MFU is not defined"
    dt = normalize_dtype(dtype)
    gpu = match_gpu(device_name)
    if gpu is None:
        return None, f"device '{device_name}' is not in dtprobe's peak table (dtprobe.catalog.GPU_MODELS)"
    if dt not in GPU_MODELS[gpu].peak_flops:
        return None, f"{device_name} has no {dt} peak in dtprobe's table"
    return GPU_MODELS[gpu].peak_flops[dt], f"{device_name} {dt} datasheet peak (dense)"
