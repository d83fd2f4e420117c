"""Device health per (rank, gpu): throttle reasons, power at its cap, memory pressure, XID errors; detectors
DEVICE_THROTTLE, DEVICE_XID, MEMORY_PRESSURE. Host-only samples (CPU/RSS fallback) carry no GPU verdicts."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.findings import Finding
from dtprobe.analysis.straggler_causes import THROTTLE_MASK
from dtprobe.analysis.tables import run_starts
from dtprobe.store.columns import require_columns

THROTTLE_REASONS = {
    0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
}
"""NVML clocks-throttle-reason bits that slow the GPU down (idle and application-clock bits are not problems)."""

HEALTH_COLUMNS = ["rank", "gpu", "num_samples", "throttled_frac", "reasons", "power_cap_frac", "max_temp_c",
                  "mean_util_frac", "max_mem_frac", "xids", "max_rss_bytes"]


HEALTH_INPUT_COLUMNS = ["rank", "gpu", "time_ns", "throttle_reasons", "power_w", "power_limit_w", "temp_c",
                        "util_frac", "mem_used_bytes", "mem_total_bytes", "xid", "rss_bytes"]
"""The ``devices`` columns ``device_health`` reads."""


def device_health(devices: pd.DataFrame, *, power_cap_ratio: float = 0.97) -> pd.DataFrame:
    """Per (rank, gpu): share of samples throttled by a slowing reason (and which), share at the power limit,
    max temperature, mean utilisation, peak memory use share, XIDs seen, peak host RSS. Columns: ``HEALTH_COLUMNS``."""
    require_columns(devices, HEALTH_INPUT_COLUMNS, table="devices")
    if devices.empty:
        return pd.DataFrame({col: [] for col in HEALTH_COLUMNS})
    reasons = devices["throttle_reasons"].astype("Int64")
    has_reason = reasons.notna().to_numpy()
    bits = reasons.fillna(0).to_numpy(dtype="int64") & THROTTLE_MASK
    power = devices["power_w"].to_numpy(dtype="float64", na_value=np.nan)
    limit = devices["power_limit_w"].to_numpy(dtype="float64", na_value=np.nan)
    total = devices["mem_total_bytes"].to_numpy(dtype="float64", na_value=np.nan)
    used = devices["mem_used_bytes"].to_numpy(dtype="float64", na_value=np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        mem_frac = np.where(total > 0, used / total, np.nan)
    rank = devices["rank"].to_numpy(dtype="int64")
    gpu = devices["gpu"].fillna(-1).to_numpy(dtype="int64")
    order = np.lexsort((gpu, rank))                     # by (rank, gpu)
    new = run_starts(rank[order], gpu[order])
    starts = np.flatnonzero(new)

    def mean(x: np.ndarray) -> np.ndarray:
        """Per (rank, gpu): mean of the measured (non-NaN) values, NaN when none."""
        v = x[order]
        count = np.add.reduceat(~np.isnan(v), starts)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, np.add.reduceat(np.nan_to_num(v, nan=0.0), starts) / count, np.nan)

    def peak(x: np.ndarray) -> np.ndarray:
        """Per (rank, gpu): max of the measured values, NaN when none."""
        return np.fmax.reduceat(x[order], starts)

    seen = np.bitwise_or.reduceat(bits[order], starts)
    out = pd.DataFrame({
        "rank": rank[order][starts], "gpu": gpu[order][starts],
        "num_samples": np.diff(np.append(starts, len(order))),
        # shares of the samples that measured it: 1.0 / 0.0 per sample, NaN when not measured
        "throttled_frac": mean(np.where(has_reason, (bits != 0).astype("float64"), np.nan)),
        "reasons": [",".join(sorted(n for bit, n in THROTTLE_REASONS.items() if b & bit)) for b in seen],
        "power_cap_frac": mean(np.where(np.isnan(power) | np.isnan(limit), np.nan,
                                        (power >= power_cap_ratio * limit).astype("float64"))),
        "max_temp_c": peak(devices["temp_c"].to_numpy(dtype="float64", na_value=np.nan)),
        "mean_util_frac": mean(devices["util_frac"].to_numpy(dtype="float64", na_value=np.nan)),
        "max_mem_frac": peak(mem_frac), "xids": "",
        "max_rss_bytes": peak(devices["rss_bytes"].to_numpy(dtype="float64", na_value=np.nan)),
    })
    xid = devices["xid"].astype("Int64")
    has_xid = (xid.fillna(0) != 0).to_numpy()
    if has_xid.any():
        xids = pd.DataFrame({"rank": rank[has_xid], "gpu": gpu[has_xid], "xid": xid[has_xid].to_numpy(dtype="int64")})
        xids = xids.groupby(["rank", "gpu"])["xid"].apply(lambda x: ",".join(str(int(v)) for v in sorted(set(x))))
        found = xids.reindex(pd.MultiIndex.from_frame(out[["rank", "gpu"]])).to_numpy(dtype=object)
        out["xids"] = pd.Series(found, index=out.index, dtype=object).where(lambda x: x.notna(), "")
    return out[HEALTH_COLUMNS]


def detect_device_health(health: pd.DataFrame, *, min_throttled_frac: float = 0.1, min_power_cap_frac: float = 0.2,
                         max_mem_frac: float = 0.95) -> list[Finding]:
    """DEVICE_THROTTLE per device throttled (slowing reasons) in at least ``min_throttled_frac`` of the samples or at
    the power cap in ``min_power_cap_frac``; DEVICE_XID (critical) per device with an XID; MEMORY_PRESSURE per
    device above ``max_mem_frac`` of its memory."""
    require_columns(health, HEALTH_COLUMNS, table="device_health")
    findings = []
    for r in health.itertuples(index=False):
        where = f"rank {r.rank} (gpu {r.gpu})"
        throttled = not pd.isna(r.throttled_frac) and r.throttled_frac >= min_throttled_frac
        capped = not pd.isna(r.power_cap_frac) and r.power_cap_frac >= min_power_cap_frac
        if throttled or capped:
            findings.append(Finding(
                code="DEVICE_THROTTLE", severity="warning", ranks=(r.rank,), group=None,
                title=(f"{where} throttles its clocks in {0 if pd.isna(r.throttled_frac) else r.throttled_frac:.0%} "
                       f"of samples ({r.reasons or 'power cap'})"),
                evidence={"rank": r.rank, "gpu": r.gpu, "throttled_frac": r.throttled_frac, "reasons": r.reasons,
                          "power_cap_frac": r.power_cap_frac, "max_temp_c": r.max_temp_c,
                          "num_samples": r.num_samples},
                recommendation=("Check cooling and power: nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE on its "
                                "host; a thermally throttled GPU makes its rank a straggler for the whole job."),
                predicted_gain=None,
            ))
        if r.xids:
            findings.append(Finding(
                code="DEVICE_XID", severity="critical", ranks=(r.rank,), group=None,
                title=f"{where} reported XID error(s) {r.xids}",
                evidence={"rank": r.rank, "gpu": r.gpu, "xids": [int(x) for x in r.xids.split(",")]},
                recommendation=("Drain the node and check the XID in NVIDIA's XID catalog (e.g. 79: fallen off the "
                                "bus, 48/63/64: ECC); restart the job from the last checkpoint without it."),
                predicted_gain=None,
            ))
        if not pd.isna(r.max_mem_frac) and r.max_mem_frac >= max_mem_frac:
            findings.append(Finding(
                code="MEMORY_PRESSURE", severity="warning", ranks=(r.rank,), group=None,
                title=f"{where} used {r.max_mem_frac:.0%} of its memory",
                evidence={"rank": r.rank, "gpu": r.gpu, "max_mem_frac": r.max_mem_frac},
                recommendation=("Reduce activation memory (activation checkpointing, smaller micro-batch) or shard "
                                "more state (ZeRO-2/3, FSDP): allocator retries and OOMs are near."),
                predicted_gain=None,
            ))
    return findings

