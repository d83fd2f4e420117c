"""Communication exposure per rank (host estimate per (rank, step), or from kernels) and the EXPOSED_COMM detector;
read by the facade.

Without kernel timings, the exposed communication of a step is estimated from the collectives table as the
communication tail (on the arrival clock of ``arrivals.on_arrival_clock``: a CUDA run's device arrivals and
NCCL's device ends, else host enqueue and completion): from the rank's last collective enqueue in the step (its compute has issued everything:
for DDP/FSDP the last gradient bucket) to the completion of its last collective. The part of that tail spent
waiting for a late peer (group's last arrival - own last enqueue; for a send/recv, the peer's matching call) is
straggler wait, reported apart and taken out (``exposed_net_ns``), so a straggler, or a pipeline stage waiting for
its neighbour (the bubble), does not show up as a communication problem. Blocking collectives in
the middle of fwd/bwd (TP) are not seen by this estimate; with kernels known, the kernel-level overlap
(``dtprobe.analysis.overlap``) is the better number.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.clocks import DEVICE, HOST
from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.analysis.tables import (P2P_OPS, attempts_of, coded_rows, completing_attempts, lookup_group_codes,
                                     p2p_pairs, run_starts, step_durations)
from dtprobe.intervals import union_length_by_group
from dtprobe.lexsort import lexsort
from dtprobe.store.columns import require_columns

EXPOSURE_COLUMNS = [
    "rank", "step", "step_ns", "comm_ns", "exposed_ns", "straggler_wait_ns", "exposed_net_ns", "exposed_frac",
    "overlap_frac",
]
BY_RANK_COLUMNS = ["rank", "num_steps", "step_ns", "comm_frac", "exposed_frac", "straggler_wait_frac",
                   "overlap_frac"]


def comm_exposure(collectives: pd.DataFrame, steps: pd.DataFrame, skew: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step): communication time (union of enqueue..end spans), exposed tail, straggler wait inside it,
    exposed net of that wait as a share of the step, overlap = 1 - exposed / comm. A step redone after a torchrun
    restart is read from the attempt that redid it (``completing_attempts``). Columns: ``EXPOSURE_COLUMNS``."""
    require_columns(collectives, ["rank", "pg", "pg_ranks", "seq", "op", "enqueue_ns", "end_ns", "step"],
                    table="collectives")
    collectives, steps = completing_attempts(collectives), completing_attempts(steps)
    extra = [col for col in ("peer", "restart") if col in collectives.columns]
    c, code, pg_names, pr_names = coded_rows(
        collectives, collectives["enqueue_ns"].notna() & collectives["end_ns"].notna() & (collectives["step"] >= 0),
        ["rank", "step", "enqueue_ns", "end_ns", "seq", "op"] + extra)
    if c.empty:
        return pd.DataFrame({col: [] for col in EXPOSURE_COLUMNS})
    rank, step = c["rank"].to_numpy(dtype="int64"), c["step"].to_numpy(dtype="int64")
    enq = c["enqueue_ns"].to_numpy(dtype="int64")
    order = lexsort((enq, step, rank))                   # per (rank, step), in arrival order
    rank, step, enq = rank[order], step[order], enq[order]
    end = np.maximum(c["end_ns"].to_numpy(dtype="int64")[order], enq)
    new = run_starts(rank, step)
    gid = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(gid)) - 1
    # Communication time: union of the [enqueue, end] spans of the (rank, step).
    comm = union_length_by_group(gid, enq, end, num_groups=len(first))
    last_enq, last_end = enq[last], np.maximum.reduceat(end, first)
    exposed = np.clip(last_end - last_enq, 0, None)
    # Straggler wait in the tail: the latest arrival of the group at collectives still running after our last enqueue.
    wait = np.zeros(len(first), dtype="int64")
    seq = c["seq"].to_numpy(dtype="float64", na_value=np.nan)[order]
    coll = np.flatnonzero(~c["op"].isin(P2P_OPS).to_numpy(dtype=bool)[order] & ~np.isnan(seq))
    if not skew.empty and len(coll):
        arrivals = pd.DataFrame({
            "code": lookup_group_codes(skew["pg"], skew["pg_ranks"], pg_names, pr_names),
            "seq": skew["seq"].to_numpy(dtype="int64"),
            "last_enqueue_ns": skew["last_enqueue_ns"].to_numpy(dtype="int64"),
        }).groupby(["code", "seq"])["last_enqueue_ns"].max()
        latest = pd.DataFrame({"code": code[order][coll], "seq": seq[coll].astype("int64")}).join(
            arrivals.astype("Int64"), on=["code", "seq"])["last_enqueue_ns"]
        in_tail = latest.notna().to_numpy() & (end[coll] > last_enq[gid[coll]])
        waited = np.clip(latest.to_numpy(dtype="int64", na_value=0)[in_tail] - last_enq[gid[coll][in_tail]], 0, None)
        np.maximum.at(wait, gid[coll][in_tail], waited)
    # a send/recv in the tail waited for its peer's matching call: a pipeline stage waiting for its neighbour
    row, peer_enq = _p2p_peer_arrivals(c, code, order)
    in_tail = end[row] > last_enq[gid[row]]
    np.maximum.at(wait, gid[row][in_tail], np.clip(peer_enq[in_tail] - last_enq[gid[row][in_tail]], 0, None))
    straggler_wait = np.minimum(wait, exposed)
    out = pd.DataFrame({"rank": rank[first], "step": step[first], "comm_ns": comm, "exposed_ns": exposed,
                        "straggler_wait_ns": straggler_wait, "exposed_net_ns": exposed - straggler_wait})
    out = out.merge(step_durations(steps), on=["rank", "step"], how="left")
    out["exposed_frac"] = out["exposed_net_ns"] / out["step_ns"]
    out["overlap_frac"] = np.where(out["comm_ns"] > 0, 1 - out["exposed_ns"] / out["comm_ns"].where(out["comm_ns"] > 0),
                                   np.nan)
    return out[EXPOSURE_COLUMNS]


def _p2p_peer_arrivals(c: pd.DataFrame, code: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions in ``order`` of the send/recv rows of ``c`` whose peer's matching call was recorded, that call's
    enqueue; ``tables.p2p_pairs``)."""
    if "peer" not in c.columns:
        none = np.empty(0, dtype="int64")
        return none, none
    pairs = p2p_pairs(group=code[order], rank=c["rank"].to_numpy(dtype="int64")[order],
                      peer=c["peer"].to_numpy(dtype="float64", na_value=np.nan)[order], op=c["op"].to_numpy()[order],
                      seq=c["seq"].to_numpy(dtype="float64", na_value=np.nan)[order],
                      step=c["step"].to_numpy(dtype="int64")[order], restart=attempts_of(c)[order],
                      enqueue=c["enqueue_ns"].to_numpy(dtype="int64")[order])
    pos = np.concatenate([pairs["row_s"].to_numpy(), pairs["row_r"].to_numpy()]).astype("int64")
    return pos, np.concatenate([pairs["enq_r"].to_numpy(), pairs["enq_s"].to_numpy()]).astype("int64")


def exposure_by_rank(exposure: pd.DataFrame, *, step_ids: list[int] | None = None) -> pd.DataFrame:
    """Per rank over ``step_ids`` (all when None): shares of the step time spent in communication, exposed (net of
    straggler wait) and waiting for stragglers, and the overlap fraction. Columns: ``BY_RANK_COLUMNS``."""
    require_columns(exposure, EXPOSURE_COLUMNS, table="comm_exposure")
    e = exposure if step_ids is None else exposure[exposure["step"].isin(step_ids)]
    e = e.dropna(subset=["step_ns"])
    if e.empty:
        return pd.DataFrame({col: [] for col in BY_RANK_COLUMNS})
    g = e.groupby("rank")
    total = g["step_ns"].sum()
    out = pd.DataFrame({
        "num_steps": g.size(), "step_ns": g["step_ns"].mean(),
        "comm_frac": g["comm_ns"].sum() / total, "exposed_frac": g["exposed_net_ns"].sum() / total,
        "straggler_wait_frac": g["straggler_wait_ns"].sum() / total,
        "overlap_frac": 1 - g["exposed_ns"].sum() / g["comm_ns"].sum().where(g["comm_ns"].sum() > 0),
    }).reset_index()
    return out[BY_RANK_COLUMNS]


KERNEL_SOURCE = "kernels (exposed comm kernel time / kernel span)"
"""``evidence.source`` of an EXPOSED_COMM judged on kernels."""


def kernel_exposure_by_rank(overlap: pd.DataFrame, temporal: pd.DataFrame) -> pd.DataFrame:
    """Per rank, from GPU kernels: communication and exposed communication kernel time as shares of the kernel
    span, overlap (``overlap.comm_comp_overlap`` and ``temporal.temporal_breakdown`` per rank). Columns:
    ``BY_RANK_COLUMNS`` (``num_steps`` 0, ``straggler_wait_frac`` NaN: kernels do not tell); empty without kernels."""
    if overlap.empty or temporal.empty or "exposed_comm_us" not in overlap.columns:
        return pd.DataFrame({col: [] for col in BY_RANK_COLUMNS})
    m = overlap.merge(temporal[["rank", "kernel_time_us"]], on="rank")
    out = pd.DataFrame({
        "rank": m["rank"], "num_steps": 0, "step_ns": m["kernel_time_us"] * 1e3,
        "comm_frac": m["comm_us"] / m["kernel_time_us"],
        "exposed_frac": m["exposed_comm_us"] / m["kernel_time_us"], "straggler_wait_frac": float("nan"),
        "overlap_frac": m["overlap_frac"]})
    return out[BY_RANK_COLUMNS]


def detect_exposed_comm_of(host: pd.DataFrame, kernels: pd.DataFrame, *, min_exposed_frac: float,
                           host_clock: str = HOST, slow_links: list[dict] = ()) -> list[Finding]:
    """EXPOSED_COMM judged on the kernel-level exposure when kernels are known (device clock), else on the
    collectives' tail estimate (``host_clock``: the clock of its arrivals and completions; ``device`` on a CUDA
    run whose collectives carry device arrivals). ``slow_links``: see ``detect_exposed_comm``."""
    if not kernels.empty:
        return detect_exposed_comm(kernels, min_exposed_frac=min_exposed_frac, source=KERNEL_SOURCE, clock=DEVICE,
                                   slow_links=slow_links)
    source = "host collectives tail" if host_clock == HOST else "collectives tail (device arrivals and ends)"
    return detect_exposed_comm(host, min_exposed_frac=min_exposed_frac, source=source, clock=host_clock,
                               slow_links=slow_links)


def mean_exposed_frac(host: pd.DataFrame, kernels: pd.DataFrame, *, clock_aligned: bool) -> float | None:
    """The Overview's exposed communication share: the host estimate's mean over ranks when the ranks' clocks are
    aligned (it needs them), else the kernel-level mean; None when that one is unknown."""
    by_rank = host if clock_aligned else kernels
    return float(by_rank["exposed_frac"].mean()) if not by_rank.empty else None


def detect_exposed_comm(by_rank: pd.DataFrame, *, min_exposed_frac: float = 0.10,
                        source: str = "host collectives tail", clock: str = HOST,
                        slow_links: list[dict] = ()) -> list[Finding]:
    """EXPOSED_COMM when the ranks' mean exposed communication (net of straggler wait) is at least
    ``min_exposed_frac`` of the step; names the ranks above the threshold. Gain bound: full overlap. ``clock``:
    the clock the exposure was measured on (``clocks``), told in ``evidence.clock``. ``slow_links``: the run's
    SLOW_LINK findings' ``nodes`` and ``changed_at_step``, in evidence and first in the advice (overlap does not
    undo a link that slowed down)."""
    require_columns(by_rank, BY_RANK_COLUMNS, table="exposure_by_rank")
    if by_rank.empty:
        return []
    mean = float(by_rank["exposed_frac"].mean())
    worst = by_rank[by_rank["exposed_frac"] >= min_exposed_frac]
    if mean < min_exposed_frac or worst.empty:
        return []
    return [Finding(
        code="EXPOSED_COMM", severity="warning", ranks=tuple(int(r) for r in worst["rank"]), group=None,
        title=(f"{mean:.0%} of the step is communication not hidden behind compute "
               f"(overlap {float(by_rank['overlap_frac'].mean()):.0%})"),
        evidence={
            "mean_exposed_frac": mean, "mean_comm_frac": float(by_rank["comm_frac"].mean()),
            "mean_overlap_frac": float(by_rank["overlap_frac"].mean()),
            "mean_straggler_wait_frac": float(by_rank["straggler_wait_frac"].mean()),
            "per_rank": [{"rank": int(r.rank), "exposed_frac": float(r.exposed_frac),
                          "overlap_frac": None if pd.isna(r.overlap_frac) else float(r.overlap_frac)}
                         for r in by_rank.itertuples(index=False)],
            "source": source, "clock": clock,
            "slow_links": [{"nodes": list(link["nodes"]), "changed_at_step": int(link["changed_at_step"])}
                           for link in slow_links],
        },
        recommendation="".join(
            f"The link {' <-> '.join(link['nodes'])} slowed down from step {link['changed_at_step']} (SLOW_LINK): "
            "the communication crossing it takes longer since then, which no overlap undoes; fix the link first. "
            for link in slow_links) + (
            "Hide communication behind compute: let DDP start all-reduces earlier (smaller first "
            "bucket, gradient_as_bucket_view), prefetch FSDP all-gathers, or shrink the traffic "
            "(gradient compression, larger micro-batches so compute covers the same bytes)."),
        predicted_gain=PredictedGain(metric="step_time", frac=mean),
        rows=by_rank,
    )]
