"""Communication efficiency: algbw/busbw per collective and by (op, size), a latency/bandwidth fit, latency-bound
small messages, bucket-size advice; and the COMM_INEFFICIENT detector. Read by the facade and the dashboard.

Transfer time of a collective = latest member completion - last member arrival (host timing: a collective
cannot progress before everyone arrived), or latest end - latest device start when NCCL/CUDA-event timing is
known. busbw = algbw x the nccl-tests factor: all-reduce 2(n-1)/n; all-gather, reduce-scatter (n-1)/n;
broadcast, reduce, send/recv 1; all-to-all (n-1)/n.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.analysis.tables import P2P_OPS, require_columns, size_label

BANDWIDTH_COLUMNS = ["pg", "pg_ranks", "seq", "op", "step", "num_bytes", "num_members", "duration_ns",
                     "algbw_bytes_per_s", "busbw_bytes_per_s", "timing"]
BY_SIZE_COLUMNS = ["op", "size_bytes", "size", "count", "total_ns", "median_ns", "algbw_bytes_per_s",
                   "busbw_bytes_per_s", "latency_bound"]


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor of ``op`` over ``n`` ranks."""
    if n <= 1:
        return 1.0
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def collective_bandwidth(collectives: pd.DataFrame) -> pd.DataFrame:
    """Per complete non-p2p collective with bytes, inside training steps (all of them when no row has a step):
    transfer time, algbw, busbw. Columns: ``BANDWIDTH_COLUMNS``."""
    require_columns(collectives, ["rank", "pg", "pg_ranks", "pg_size", "seq", "op", "num_bytes", "enqueue_ns",
                                  "start_ns", "end_ns", "step", "timing"], table="collectives")
    c = collectives[~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna() & collectives["end_ns"].notna()
                    & (collectives["num_bytes"].fillna(0) > 0)]
    in_steps = c["step"].fillna(-1) >= 0
    if in_steps.any():      # training collectives only: setup broadcasts and checkpoint metadata run outside steps
        c = c[in_steps]
    if c.empty:
        return pd.DataFrame({col: [] for col in BANDWIDTH_COLUMNS})
    c = c.assign(pg=c["pg"].fillna("").astype(str), pg_ranks=c["pg_ranks"].fillna("").astype(str))
    g = c.groupby(["pg", "pg_ranks", "seq"], sort=False)
    out = g.agg(op=("op", "first"), step=("step", "max"), num_bytes=("num_bytes", "max"),
                num_members=("rank", "nunique"), pg_size=("pg_size", "max"), last_enq=("enqueue_ns", "max"),
                last_start=("start_ns", "max"), last_end=("end_ns", "max"), timing=("timing", "first"))
    out = out[out["num_members"] >= out["pg_size"].fillna(out["num_members"])]
    device = out["last_start"].notna()
    start = out["last_start"].where(device, out["last_enq"])
    out["duration_ns"] = (out["last_end"] - start).astype("float64").clip(lower=1.0)
    out["algbw_bytes_per_s"] = out["num_bytes"].astype("float64") / (out["duration_ns"] / 1e9)
    factors = [busbw_factor(op, int(n)) for op, n in zip(out["op"], out["num_members"])]
    out["busbw_bytes_per_s"] = out["algbw_bytes_per_s"] * np.asarray(factors)
    out["timing"] = out["timing"].fillna("host").astype(str)
    out = out.reset_index()
    out["num_members"] = out["num_members"].astype("int64")
    return out[BANDWIDTH_COLUMNS]


def latency_bandwidth_fit(bw: pd.DataFrame, *, min_samples: int = 3) -> tuple[float, float] | None:
    """Least-squares fit of transfer time = alpha + bytes / beta over ``bw``'s collectives of the op taking the most
    time, using per-size medians of sizes seen ``min_samples`` times; (alpha_ns, beta_bytes_per_s), or None with
    fewer than two such sizes or a non-physical fit."""
    if bw.empty:
        return None
    op = bw.groupby("op")["duration_ns"].sum().idxmax()
    d = bw[bw["op"] == op]
    sizes = d.groupby("num_bytes")["duration_ns"]
    med = sizes.median()[sizes.size() >= min_samples]
    if len(med) < 2:
        return None
    x, y = med.index.to_numpy(dtype="float64"), med.to_numpy(dtype="float64")
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0 or intercept < 0:
        return None
    return float(intercept), float(1e9 / slope)


def bandwidth_by_size(bw: pd.DataFrame, *, fit: tuple[float, float] | None = None,
                      small_bytes: int = 256 * 1024) -> pd.DataFrame:
    """Per (op, power-of-two size bucket): count, total and median transfer time, median algbw/busbw, and
    whether the bucket is latency-bound (below the fit's half-bandwidth size alpha x beta, or below
    ``small_bytes`` without a fit). Columns: ``BY_SIZE_COLUMNS``."""
    require_columns(bw, BANDWIDTH_COLUMNS, table="collective_bandwidth")
    if bw.empty:
        return pd.DataFrame({col: [] for col in BY_SIZE_COLUMNS})
    size = (2 ** np.ceil(np.log2(bw["num_bytes"].astype("float64").clip(lower=1)))).astype("int64")
    g = bw.assign(size_bytes=size).groupby(["op", "size_bytes"])
    out = g.agg(count=("seq", "size"), total_ns=("duration_ns", "sum"), median_ns=("duration_ns", "median"),
                algbw_bytes_per_s=("algbw_bytes_per_s", "median"),
                busbw_bytes_per_s=("busbw_bytes_per_s", "median")).reset_index()
    half = fit[0] * fit[1] / 1e9 if fit else small_bytes
    out["latency_bound"] = out["size_bytes"] < half
    out["size"] = [size_label(s) for s in out["size_bytes"]]
    return out[BY_SIZE_COLUMNS]


def detect_comm_inefficient(bw: pd.DataFrame, by_size: pd.DataFrame, *, fit: tuple[float, float] | None,
                            step_ns: float | None, num_steps: int, peak_busbw_bytes_per_s: float | None = None,
                            min_latency_share: float = 0.2, min_small_count: int = 10,
                            min_peak_frac: float = 0.5) -> list[Finding]:
    """COMM_INEFFICIENT when latency-bound small messages (``min_small_count`` or more) take at least
    ``min_latency_share`` of the collective time and could be merged (several in the same group and step, at
    least one mergeable per step on average) (advice: buckets of at least 4x the half-bandwidth size, gain: the latencies saved by merging), or
    when the large messages' busbw is below ``min_peak_frac`` of a given link peak."""
    require_columns(by_size, BY_SIZE_COLUMNS, table="bandwidth_by_size")
    if by_size.empty:
        return []
    findings = []
    total = float(by_size["total_ns"].sum())
    small = by_size[by_size["latency_bound"]]
    small_ns, small_count = float(small["total_ns"].sum()), int(small["count"].sum())
    half = fit[0] * fit[1] / 1e9 if fit else 256 * 1024
    # Only collectives that could be merged matter: several latency-bound ones in the same group and step.
    small_rows = bw[bw["num_bytes"] < half]
    per_group_step = small_rows.groupby(["pg_ranks", "step"]).size()
    mergeable = int((per_group_step - 1).clip(lower=0).sum())
    if (total > 0 and small_ns / total >= min_latency_share and small_count >= min_small_count
            and mergeable >= max(1, num_steps)):      # at least one mergeable collective per step
        target = int(2 ** np.ceil(np.log2(max(4 * half, 1))))
        alpha = fit[0] if fit else float(small["median_ns"].min())
        sizes = small_rows.groupby(["pg_ranks", "step"])["num_bytes"].sum()
        merged = np.maximum(1.0, np.ceil(sizes / target))
        saved_ns = float(((per_group_step - merged.reindex(per_group_step.index)).clip(lower=0) * alpha).sum())
        gain = None
        if step_ns and num_steps:
            gain = PredictedGain(metric="step_time", frac=min(1.0, saved_ns / num_steps / step_ns))
        findings.append(Finding(
            code="COMM_INEFFICIENT", severity="warning", ranks=(), group=None,
            title=(f"{small_count} latency-bound collectives (< {size_label(half)}) take "
                   f"{small_ns / total:.0%} of the collective time"),
            evidence={
                "latency_bound_share": small_ns / total, "num_latency_bound": small_count,
                "num_mergeable": mergeable,
                "num_collectives": int(by_size["count"].sum()),
                "latency_us": alpha / 1e3 if alpha else None,
                "bandwidth_gbps": fit[1] * 8 / 1e9 if fit else None,
                "half_bandwidth_bytes": half, "recommended_bucket_bytes": target,
                "by_size": [{"op": r.op, "size": r.size, "count": int(r.count),
                             "busbw_gbps": float(r.busbw_bytes_per_s) * 8 / 1e9, "latency_bound": bool(r.latency_bound)}
                            for r in by_size.itertuples(index=False)],
            },
            recommendation=(f"Merge small collectives: set DDP bucket_cap_mb (or FSDP/ZeRO bucket size) to at least "
                            f"{size_label(target)} (4x the size at which bandwidth reaches half its peak), and "
                            f"batch small tensors (flatten before all-reduce)."),
            predicted_gain=gain, rows=by_size,
        ))
    if peak_busbw_bytes_per_s:
        large = by_size[~by_size["latency_bound"]]
        if not large.empty:
            busbw = float(np.average(large["busbw_bytes_per_s"], weights=large["total_ns"]))
            if busbw < min_peak_frac * peak_busbw_bytes_per_s:
                findings.append(Finding(
                    code="COMM_INEFFICIENT", severity="warning", ranks=(), group=None,
                    title=(f"large collectives reach {busbw * 8 / 1e9:.1f} Gb/s bus bandwidth, "
                           f"{busbw / peak_busbw_bytes_per_s:.0%} of the link peak"),
                    evidence={"busbw_gbps": busbw * 8 / 1e9, "peak_busbw_gbps": peak_busbw_bytes_per_s * 8 / 1e9,
                              "peak_frac": busbw / peak_busbw_bytes_per_s},
                    recommendation=("Check the network path: NCCL_DEBUG=INFO for the transport (IB vs sockets), "
                                    "NCCL_IB_HCA/NCCL_SOCKET_IFNAME, GPU-NIC affinity, and run nccl-tests "
                                    "all_reduce_perf to compare."),
                    predicted_gain=None, rows=large,
                ))
    return findings
