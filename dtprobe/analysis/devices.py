"""Device health per (rank, gpu): throttle reasons, power at its cap, memory pressure, XID errors; detectors
DEVICE_THROTTLE, DEVICE_XID, MEMORY_PRESSURE. Host-only samples (CPU/RSS fallback) carry no GPU verdicts."""

from __future__ import annotations

import pandas as pd

from dtprobe.analysis.findings import Finding
from dtprobe.analysis.stragglers import THROTTLE_MASK
from dtprobe.analysis.tables import require_columns

THROTTLE_REASONS = {
    0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
}
"""NVML clocks-throttle-reason bits that slow the GPU down (idle and application-clock bits are not problems)."""

HEALTH_COLUMNS = ["rank", "gpu", "num_samples", "throttled_frac", "reasons", "power_cap_frac", "max_temp_c",
                  "mean_util_frac", "max_mem_frac", "xids", "max_rss_bytes"]


def device_health(devices: pd.DataFrame, *, power_cap_ratio: float = 0.97) -> pd.DataFrame:
    """Per (rank, gpu): share of samples throttled by a slowing reason (and which), share at the power limit,
    max temperature, mean utilisation, peak memory use share, XIDs seen, peak host RSS. Columns: ``HEALTH_COLUMNS``."""
    require_columns(devices, ["rank", "gpu", "time_ns", "throttle_reasons", "power_w", "power_limit_w", "temp_c",
                              "util_frac", "mem_used_bytes", "mem_total_bytes", "xid", "rss_bytes"], table="devices")
    if devices.empty:
        return pd.DataFrame({col: [] for col in HEALTH_COLUMNS})
    d = pd.DataFrame({"rank": devices["rank"].astype("int64"), "gpu": devices["gpu"].fillna(-1).astype("int64")})
    reasons = devices["throttle_reasons"].astype("Int64")
    bits = (reasons.fillna(0).astype("int64") & THROTTLE_MASK)
    d["has_reason"] = reasons.notna()
    d["throttled"] = (bits != 0).where(reasons.notna())
    for bit, name in THROTTLE_REASONS.items():
        d[name] = (bits & bit) != 0
    power = devices["power_w"].astype("float64")
    limit = devices["power_limit_w"].astype("float64")
    d["capped"] = (power >= power_cap_ratio * limit).where(power.notna() & limit.notna())
    total = devices["mem_total_bytes"].astype("float64")
    d["mem_frac"] = (devices["mem_used_bytes"].astype("float64") / total).where(total > 0)
    d["temp"] = devices["temp_c"].astype("float64")
    d["util"] = devices["util_frac"].astype("float64")
    d["rss"] = devices["rss_bytes"].astype("float64")
    xid = devices["xid"].astype("Int64")
    d["xid"] = xid.where(xid.fillna(0) != 0)
    g = d.groupby(["rank", "gpu"], sort=True)
    out = g.agg(num_samples=("rank", "size"), throttled_frac=("throttled", "mean"), power_cap_frac=("capped", "mean"),
                max_temp_c=("temp", "max"), mean_util_frac=("util", "mean"), max_mem_frac=("mem_frac", "max"),
                max_rss_bytes=("rss", "max"))
    seen = g[list(THROTTLE_REASONS.values())].any()
    out["reasons"] = [",".join(sorted(n for n in THROTTLE_REASONS.values() if row[n])) for _, row in seen.iterrows()]
    xids = d.dropna(subset=["xid"]).groupby(["rank", "gpu"])["xid"].apply(
        lambda x: ",".join(str(int(v)) for v in sorted(set(x))))
    out["xids"] = xids.reindex(out.index).astype(object).where(lambda x: x.notna(), "") if len(xids) else ""
    out = out.reset_index()
    for col in ("throttled_frac", "power_cap_frac"):
        out[col] = out[col].astype("float64")
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

