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

from dtprobe.analysis.clocks import clock_of_timing
from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.analysis.tables import P2P_OPS, coded_rows, run_starts, size_label
from dtprobe.lexsort import lexsort
from dtprobe.store.columns import require_columns

BANDWIDTH_COLUMNS = ["pg", "pg_ranks", "seq", "op", "step", "num_bytes", "num_members", "duration_ns",
                     "algbw_bytes_per_s", "busbw_bytes_per_s", "timing"]
BANDWIDTH_ORDER = ["step", "pg", "pg_ranks", "seq"]
"""``collective_bandwidth``'s row order (unique: one row per collective)."""
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
    transfer time, algbw, busbw. Columns: ``BANDWIDTH_COLUMNS``, rows in ``BANDWIDTH_ORDER``."""
    require_columns(collectives, ["rank", "pg", "pg_ranks", "pg_size", "seq", "op", "num_bytes", "enqueue_ns",
                                  "start_ns", "end_ns", "step", "timing"], table="collectives")
    mask = (~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna() & collectives["end_ns"].notna()
            & (collectives["num_bytes"].fillna(0) > 0))
    in_steps = mask & (collectives["step"].fillna(-1) >= 0)
    if in_steps.any():      # training collectives only: setup broadcasts and checkpoint metadata run outside steps
        mask = in_steps
    c, code, pg_names, pr_names = coded_rows(collectives, mask, ["rank", "pg_size", "seq", "op", "num_bytes",
                                                                 "enqueue_ns", "start_ns", "end_ns", "step", "timing"])
    if c.empty:
        return pd.DataFrame({col: [] for col in BANDWIDTH_COLUMNS})
    seq, rank = c["seq"].to_numpy(dtype="int64"), c["rank"].to_numpy(dtype="int64")
    order = lexsort((np.arange(len(c)), seq, code))         # by collective, then table order
    new = run_starts(code[order], seq[order])
    starts, coll = np.flatnonzero(new), np.cumsum(new) - 1
    by_rank = lexsort((rank[order], coll))
    num_members = np.bincount(coll[by_rank][run_starts(coll[by_rank], rank[order][by_rank])], minlength=len(starts))
    pg_size = np.fmax.reduceat(c["pg_size"].to_numpy(dtype="float64", na_value=np.nan)[order], starts)
    whole = num_members >= np.where(np.isnan(pg_size), num_members, pg_size)
    keep = np.flatnonzero(whole)
    first_row = order[starts][keep]
    step, num_bytes, last_enq, last_start, last_end = (_max_per_group(c[col], order, starts)[keep] for col in (
        "step", "num_bytes", "enqueue_ns", "start_ns", "end_ns"))
    start = last_start.fillna(last_enq)                        # device start when known, else the last arrival
    duration = np.clip((last_end - start).to_numpy(dtype="float64", na_value=np.nan), 1.0, None)
    algbw = num_bytes.to_numpy(dtype="float64", na_value=np.nan) / (duration / 1e9)
    op = _first_valid(c["op"], order, starts)[keep]
    members = num_members[keep]
    ops = op.to_numpy(dtype=object, na_value=None)
    factor = {(o, n): busbw_factor(o, int(n)) for o, n in set(zip(ops, members))}
    out = pd.DataFrame({
        "pg": pg_names.take(code[first_row]), "pg_ranks": pr_names.take(code[first_row]),
        "seq": pd.array(seq[first_row], dtype="Int64"), "op": op, "step": step, "num_bytes": num_bytes,
        "num_members": members.astype("int64"), "duration_ns": duration, "algbw_bytes_per_s": algbw,
        "busbw_bytes_per_s": algbw * np.array([factor[o, n] for o, n in zip(ops, members)], dtype="float64"),
        "timing": pd.Series(_first_valid(c["timing"], order, starts)[keep]).fillna("host").astype(str),
    })
    # an explicit order (not the rows' table order, which is rank-first across the whole run): a step block's
    # collectives computed alone (``derived_tables``) then sort into the same frame
    return out.sort_values(BANDWIDTH_ORDER, kind="stable", na_position="last").reset_index(drop=True)[
        BANDWIDTH_COLUMNS]


def _max_per_group(col: pd.Series, order: np.ndarray, starts: np.ndarray) -> pd.arrays.IntegerArray:
    """Max of an integer column per group (rows ``order``-ed, groups beginning at ``starts``), null when all are."""
    low = np.iinfo("int64").min
    top = np.maximum.reduceat(col.to_numpy(dtype="int64", na_value=low)[order], starts)
    return pd.arrays.IntegerArray(top, top == low)


def _first_valid(col: pd.Series, order: np.ndarray, starts: np.ndarray):
    """First non-null value of a column per group (rows ``order``-ed, groups beginning at ``starts``), as ``first``."""
    valid = np.flatnonzero(col.notna().to_numpy(dtype=bool)[order])
    pos = np.full(len(starts), -1, dtype="int64")
    group = np.searchsorted(starts, valid, side="right") - 1
    pos[group[::-1]] = order[valid[::-1]]                    # the first valid row of each group wins
    return col.array.take(pos, allow_fill=True)


def latency_bandwidth_fit(bw: pd.DataFrame, *, min_samples: int = 3) -> tuple[float, float] | None:
    """Least-squares fit of transfer time = alpha + bytes / beta over ``bw``'s collectives of the op taking the most
    time, using per-size medians of sizes seen ``min_samples`` times; (alpha_ns, beta_bytes_per_s), or None with
    fewer than two such sizes or a non-physical fit."""
    if bw.empty:
        return None
    op = bw.groupby("op")["duration_ns"].sum().idxmax()
    d = bw.loc[bw["op"] == op, ["num_bytes", "duration_ns"]]     # the columns read: no copy of the group texts
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
    size = (2 ** np.ceil(np.log2(bw["num_bytes"].astype("float64").clip(lower=1)))).to_numpy(dtype="int64")
    op_code, ops = pd.factorize(bw["op"], sort=True)
    known = np.flatnonzero(op_code >= 0)                       # collectives without an op are left out
    if not len(known):
        return pd.DataFrame({col: [] for col in BY_SIZE_COLUMNS})
    order = known[np.lexsort((size[known], op_code[known]))]   # by (op, size bucket)
    starts = np.flatnonzero(run_starts(op_code[order], size[order]))
    duration = bw["duration_ns"].to_numpy(dtype="float64", na_value=np.nan)[order]
    out = pd.DataFrame({
        "op": ops.take(op_code[order][starts]), "size_bytes": size[order][starts],
        "count": pd.array(np.diff(np.append(starts, len(order))), dtype="Int64"),
        "total_ns": np.add.reduceat(np.nan_to_num(duration, nan=0.0), starts),
        "median_ns": _median_per_group(duration, starts),
        "algbw_bytes_per_s": _median_per_group(bw["algbw_bytes_per_s"].to_numpy(dtype="float64")[order], starts),
        "busbw_bytes_per_s": _median_per_group(bw["busbw_bytes_per_s"].to_numpy(dtype="float64")[order], starts),
    })
    half = fit[0] * fit[1] / 1e9 if fit else small_bytes
    out["latency_bound"] = out["size_bytes"] < half
    out["size"] = [size_label(s) for s in out["size_bytes"]]
    return out[BY_SIZE_COLUMNS]


def _median_per_group(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Median of the non-NaN values of each group (the runs of ``values`` beginning at ``starts``), NaN when none."""
    # groups are (op, size bucket) pairs: few, each a selection (np.median partitions), no sort of all rows
    ends = np.append(starts[1:], len(values))
    out = np.full(len(starts), np.nan)
    for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        x = values[s:e]
        x = x[~np.isnan(x)]
        if len(x):
            out[i] = np.median(x)
    return out


def detect_comm_inefficient(bw: pd.DataFrame, by_size: pd.DataFrame, *, fit: tuple[float, float] | None,
                            step_ns: float | None, num_steps: int, peak_busbw_bytes_per_s: float | None = None,
                            min_latency_share: float = 0.2, min_small_count: int = 10,
                            min_peak_frac: float = 0.5) -> list[Finding]:
    """COMM_INEFFICIENT when latency-bound small messages (``min_small_count`` or more) take at least
    ``min_latency_share`` of the collective time and could be merged (several in the same group and step, at
    least one mergeable per step on average) (advice: buckets of at least 4x the half-bandwidth size, gain: the latencies saved by merging), or
    when the large messages' busbw is below ``min_peak_frac`` of a given link peak. ``evidence.clock``: the clock of
    the transfer times (``device`` when every collective has NCCL's device timing, ``cuda_event``)."""
    require_columns(by_size, BY_SIZE_COLUMNS, table="bandwidth_by_size")
    if by_size.empty:
        return []
    clock = clock_of_timing(bw["timing"])
    findings = []
    total = float(by_size["total_ns"].sum())
    small = by_size[by_size["latency_bound"]]
    small_ns, small_count = float(small["total_ns"].sum()), int(small["count"].sum())
    half = fit[0] * fit[1] / 1e9 if fit else 256 * 1024
    # Only collectives that could be merged matter: several latency-bound ones in the same group and step.
    # the columns read (no copy of the other columns' strings), grouped once
    is_small = (bw["num_bytes"] < half).to_numpy(dtype=bool, na_value=False)
    small_rows = bw[["pg_ranks", "step", "num_bytes"]]
    small_rows = small_rows if is_small.all() else small_rows[is_small]
    by_group_step = small_rows.groupby(["pg_ranks", "step"])
    per_group_step = by_group_step.size()
    mergeable = int((per_group_step - 1).clip(lower=0).sum())
    if (total > 0 and small_ns / total >= min_latency_share and small_count >= min_small_count
            and mergeable >= max(1, num_steps)):      # at least one mergeable collective per step
        target = int(2 ** np.ceil(np.log2(max(4 * half, 1))))
        alpha = fit[0] if fit else float(small["median_ns"].min())
        sizes = by_group_step["num_bytes"].sum()
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
                "clock": clock, "latency_bound_share": small_ns / total, "num_latency_bound": small_count,
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
                    evidence={"clock": clock, "busbw_gbps": busbw * 8 / 1e9, "peak_busbw_gbps": peak_busbw_bytes_per_s * 8 / 1e9,
                              "peak_frac": busbw / peak_busbw_bytes_per_s},
                    recommendation=("Check the network path: NCCL_DEBUG=INFO for the transport (IB vs sockets), "
                                    "NCCL_IB_HCA/NCCL_SOCKET_IFNAME, GPU-NIC affinity, and run nccl-tests "
                                    "all_reduce_perf to compare."),
                    predicted_gain=None, rows=large,
                ))
    return findings
