"""Gradient-compression metrics (ratio, bytes and time saved, encode/decode cost, loss gap against a baseline
run) and the COMPRESSION detector; read by the facade (``--baseline RUN``) and the dashboard."""

from __future__ import annotations

import pandas as pd

from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.store.columns import require_columns

COMPRESSION_COLUMNS = ["method", "num_steps", "raw_bytes", "sent_bytes", "ratio", "bytes_saved_frac",
                       "raw_bytes_per_step", "sent_bytes_per_step", "encode_ns_per_step", "decode_ns_per_step"]
LOSS_GAP_COLUMNS = ["num_common_steps", "last_steps", "loss", "baseline_loss", "loss_gap_frac"]


def compression_summary(compression: pd.DataFrame) -> pd.DataFrame:
    """Per method, summed over ranks and buckets and averaged per step and rank: bytes before/after, ratio,
    share of bytes saved, encode/decode time per step. Columns: ``COMPRESSION_COLUMNS``."""
    require_columns(compression, ["rank", "step", "bucket", "method", "raw_bytes", "sent_bytes", "encode_ns",
                                  "decode_ns"], table="compression")
    c = compression.dropna(subset=["raw_bytes", "sent_bytes"])
    if c.empty:
        return pd.DataFrame({col: [] for col in COMPRESSION_COLUMNS})
    rows = []
    for method, g in c.groupby(c["method"].fillna("unknown"), sort=True):
        n_steps = max(1, g["step"].nunique())
        n_ranks = max(1, g["rank"].nunique())
        raw, sent = float(g["raw_bytes"].sum()), float(g["sent_bytes"].sum())
        rows.append({
            "method": str(method), "num_steps": int(n_steps), "raw_bytes": raw, "sent_bytes": sent,
            "ratio": raw / sent if sent else float("inf"), "bytes_saved_frac": 1 - sent / raw if raw else 0.0,
            "raw_bytes_per_step": raw / n_steps / n_ranks, "sent_bytes_per_step": sent / n_steps / n_ranks,
            "encode_ns_per_step": float(g["encode_ns"].fillna(0).sum()) / n_steps / n_ranks,
            "decode_ns_per_step": float(g["decode_ns"].fillna(0).sum()) / n_steps / n_ranks,
        })
    return pd.DataFrame(rows)[COMPRESSION_COLUMNS]


def measured_saving_ns(bandwidth: pd.DataFrame, baseline_bandwidth: pd.DataFrame | None) -> float | None:
    """Median per-step collective time of the baseline minus this run's (``comm_efficiency.collective_bandwidth``
    rows of each); None without a baseline or without collectives in either."""
    if baseline_bandwidth is None or bandwidth.empty or baseline_bandwidth.empty:
        return None
    return float(baseline_bandwidth.groupby("step")["duration_ns"].sum().median()
                 - bandwidth.groupby("step")["duration_ns"].sum().median())


def median_allreduce_algbw(bandwidth: pd.DataFrame) -> float | None:
    """Median algorithm bandwidth (bytes/s) of the all-reduces; None without any."""
    ar = bandwidth[bandwidth["op"] == "allreduce"] if not bandwidth.empty else bandwidth
    return float(ar["algbw_bytes_per_s"].median()) if not ar.empty else None


def loss_curve(steps: pd.DataFrame) -> pd.Series:
    """Mean loss over ranks per step (index: step)."""
    require_columns(steps, ["rank", "step", "loss"], table="steps")
    s = steps.dropna(subset=["loss"])
    return s.groupby("step")["loss"].mean().sort_index()


def loss_gap(steps: pd.DataFrame, baseline_steps: pd.DataFrame | None, *, last_steps: int = 5) -> pd.DataFrame:
    """Mean loss over the last ``last_steps`` steps both runs have, this run vs the baseline; gap as a share of
    the baseline loss (positive: this run is worse). One row, columns ``LOSS_GAP_COLUMNS``; empty without
    a baseline or without common steps."""
    if baseline_steps is None:
        return pd.DataFrame({col: [] for col in LOSS_GAP_COLUMNS})
    mine, base = loss_curve(steps), loss_curve(baseline_steps)
    common = mine.index.intersection(base.index)
    if len(common) == 0:
        return pd.DataFrame({col: [] for col in LOSS_GAP_COLUMNS})
    tail = common[-last_steps:]
    loss, ref = float(mine[tail].mean()), float(base[tail].mean())
    return pd.DataFrame([{"num_common_steps": len(common), "last_steps": len(tail), "loss": loss,
                          "baseline_loss": ref, "loss_gap_frac": (loss - ref) / abs(ref) if ref else 0.0}])[
        LOSS_GAP_COLUMNS]


def detect_compression(summary: pd.DataFrame, gap: pd.DataFrame | None, *, algbw_bytes_per_s: float | None,
                       step_ns: float | None, baseline: str | None = None, max_loss_gap_frac: float = 0.02,
                       measured_saved_ns: float | None = None) -> list[Finding]:
    """COMPRESSION for each method used: info with ratio and estimated time saved (bytes saved / measured
    all-reduce algbw, minus encode+decode); warning when the loss gap to the baseline reaches
    ``max_loss_gap_frac`` or the encode/decode cost exceeds the transfer time saved. ``measured_saved_ns``: the
    baseline's median per-step collective transfer time minus this run's (when a baseline is given)."""
    require_columns(summary, COMPRESSION_COLUMNS, table="compression_summary")
    findings = []
    for r in summary.itertuples(index=False):
        saved_bytes = r.raw_bytes_per_step - r.sent_bytes_per_step
        transfer_saved_ns = saved_bytes / algbw_bytes_per_s * 1e9 if algbw_bytes_per_s else None
        overhead_ns = r.encode_ns_per_step + r.decode_ns_per_step
        net_ns = transfer_saved_ns - overhead_ns if transfer_saved_ns is not None else None
        g = gap.iloc[0] if gap is not None and not gap.empty else None
        gap_frac = float(g["loss_gap_frac"]) if g is not None else None
        problems = []
        if gap_frac is not None and gap_frac >= max_loss_gap_frac:
            problems.append(f"loss is {gap_frac:.1%} worse than the baseline")
        if net_ns is not None and net_ns < 0:
            problems.append("encoding costs more time than the smaller transfer saves")
        title = (f"{r.method} compression: {r.ratio:.1f}x fewer bytes ({r.bytes_saved_frac:.0%} saved)"
                 + (f", ~{net_ns / 1e6:.1f} ms/step net" if net_ns is not None else "")
                 + (f", loss gap {gap_frac:+.1%} vs baseline" if gap_frac is not None else ""))
        findings.append(Finding(
            code="COMPRESSION", severity="warning" if problems else "info", ranks=(), group="dp",
            title=title,
            evidence={
                "method": r.method, "ratio": r.ratio, "bytes_saved_frac": r.bytes_saved_frac,
                "raw_mb_per_step": r.raw_bytes_per_step / 1e6, "sent_mb_per_step": r.sent_bytes_per_step / 1e6,
                "encode_ms_per_step": r.encode_ns_per_step / 1e6, "decode_ms_per_step": r.decode_ns_per_step / 1e6,
                "transfer_saved_ms_per_step": transfer_saved_ns / 1e6 if transfer_saved_ns is not None else None,
                "net_saved_ms_per_step": net_ns / 1e6 if net_ns is not None else None,
                "algbw_gbps_used": algbw_bytes_per_s * 8 / 1e9 if algbw_bytes_per_s else None,
                "measured_transfer_saved_ms_per_step": (measured_saved_ns / 1e6 if measured_saved_ns is not None
                                                        else None),
                "baseline": baseline, "loss": float(g["loss"]) if g is not None else None,
                "baseline_loss": float(g["baseline_loss"]) if g is not None else None,
                "loss_gap_frac": gap_frac,
            },
            recommendation=("; ".join(problems).capitalize() + ": use a gentler method (fp16/bf16 instead of "
                            "top-k/PowerSGD, higher rank), keep error feedback on, or drop compression on fast links."
                            if problems else
                            ("Compression works; compare against a run without it (--baseline RUN) to check the "
                             "loss." if gap_frac is None else "Compression saves bandwidth at no visible loss cost.")),
            predicted_gain=(PredictedGain(metric="step_time", frac=min(1.0, -net_ns / step_ns))
                            if net_ns is not None and net_ns < 0 and step_ns else None),
            rows=summary,
        ))
    return findings
