"""Throughput per step (tokens/s over all ranks) and MFU against the device's peak; the LOW_MFU detector; read by
the facade."""

from __future__ import annotations

import pandas as pd

from dtprobe.analysis.findings import Finding
from dtprobe.analysis.peaks import preset_flops_per_token
from dtprobe.store.columns import require_columns

THROUGHPUT_COLUMNS = ["step", "num_ranks", "step_ns", "tokens", "tokens_per_s", "model_flops_per_s", "mfu"]


def flops_per_token(config: dict) -> float | None:
    """Model training FLOPs per token: config ``model_flops_per_token``, else the built-in preset's shape at the
    config's ``train.seq_len``; None when neither is known."""
    if config.get("model_flops_per_token"):
        return float(config["model_flops_per_token"])
    name = (config.get("model") or {}).get("name")
    seq = (config.get("train") or {}).get("seq_len")
    return preset_flops_per_token(name, int(seq)) if name and seq else None


def dp_tokens(steps: pd.DataFrame, *, layout: dict) -> pd.DataFrame:
    """``steps`` with ``tokens`` divided by tp x pp of ``layout``: the ranks of one model replica each record the
    replica's batch, which counts once."""
    replicas = int(layout.get("tp") or 1) * int(layout.get("pp") or 1)
    if replicas > 1 and not steps.empty:
        return steps.assign(tokens=steps["tokens"].astype("float64") / replicas)
    return steps


def throughput(steps: pd.DataFrame, *, flops_per_token: float | None, peak_flops_per_device: float | None,
               num_devices: int) -> pd.DataFrame:
    """Per step: wall time (first start to last end over ranks), tokens of all ranks (``tokens`` is per rank;
    ranks that hold the same batch (tp, pp) must record 0 or the config must say so), tokens/s, achieved model
    FLOP/s, and MFU = model FLOP/s / (devices x peak) when both are known. Columns: ``THROUGHPUT_COLUMNS``."""
    require_columns(steps, ["rank", "step", "start_ns", "end_ns", "tokens"], table="steps")
    s = steps.dropna(subset=["start_ns", "end_ns"])
    if s.empty:
        return pd.DataFrame({col: [] for col in THROUGHPUT_COLUMNS})
    g = s.groupby("step")
    out = pd.DataFrame({
        "num_ranks": g["rank"].nunique(), "step_ns": (g["end_ns"].max() - g["start_ns"].min()).astype("float64"),
        "tokens": g["tokens"].sum(min_count=1).astype("float64"),
    }).reset_index()
    out["tokens_per_s"] = out["tokens"] / (out["step_ns"] / 1e9)
    out["model_flops_per_s"] = out["tokens_per_s"] * flops_per_token if flops_per_token else float("nan")
    if flops_per_token and peak_flops_per_device and num_devices:
        out["mfu"] = out["model_flops_per_s"] / (peak_flops_per_device * num_devices)
    else:
        out["mfu"] = float("nan")
    out["step"] = out["step"].astype("int64")
    return out[THROUGHPUT_COLUMNS]


def throughput_summary(per_step: pd.DataFrame, *, step_ids: list[int] | None, peak_reason: str,
                       flops_per_token: float | None) -> dict:
    """Median over ``step_ids`` of step time, tokens/s, model FLOP/s and MFU (null with ``mfu_reason``)."""
    p = per_step if not step_ids else per_step[per_step["step"].isin(step_ids)]
    if p.empty:
        return {}
    mfu = p["mfu"].median()
    return {
        "num_steps": int(len(p)), "step_time_ms": float(p["step_ns"].median()) / 1e6,
        "tokens_per_s": float(p["tokens_per_s"].median()) if p["tokens_per_s"].notna().any() else None,
        "flops_per_token": flops_per_token,
        "model_tflops_per_s": (float(p["model_flops_per_s"].median()) / 1e12
                               if p["model_flops_per_s"].notna().any() else None),
        "mfu": None if pd.isna(mfu) else float(mfu),
        "mfu_reason": (f"vs {peak_reason}" if not pd.isna(mfu) else
                       "model FLOPs per token unknown (no built-in preset in the config; set "
                       "config.model_flops_per_token)" if not flops_per_token else
                       "tokens per step not recorded" if p["tokens_per_s"].isna().all() else peak_reason),
    }


def detect_low_mfu(summary: dict, *, min_mfu: float = 0.2) -> list[Finding]:
    """LOW_MFU (info) when MFU is known and below ``min_mfu``: points at the other findings for where time goes."""
    mfu = summary.get("mfu") if summary else None
    if mfu is None or mfu >= min_mfu:
        return []
    return [Finding(
        code="LOW_MFU", severity="info", ranks=(), group=None,
        title=f"model FLOPs utilisation is {mfu:.1%} ({summary['model_tflops_per_s']:.1f} TFLOP/s achieved)",
        evidence=dict(summary),
        recommendation=("Look at the other findings for where the time goes (exposed communication, bubbles, "
                        "stragglers); raise the micro-batch size or use bf16 autocast if the device is underfed."),
        predicted_gain=None,
    )]
