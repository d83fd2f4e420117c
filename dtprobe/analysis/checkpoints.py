"""Checkpoint latency metrics (blocking vs async, per-rank max, share of wall time, Young/Daly interval) and the
CHECKPOINT_STALL detector; read by the facade and the dashboard's reliability page."""

from __future__ import annotations

import math

import pandas as pd

from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.store.columns import require_columns

SAVE_COLUMNS = ["step", "kind", "num_ranks", "blocking_max_ns", "blocking_mean_ns", "async_max_ns", "total_max_ns",
                "slowest_rank", "num_bytes", "ok"]
DEFAULT_MTBF_HOURS = 24.0
"""Mean time between failures assumed for the Young/Daly interval when none is given (one failure a day)."""


def checkpoint_events(checkpoints: pd.DataFrame) -> pd.DataFrame:
    """One row per checkpoint (step, kind): the slowest rank's blocking / async / total time, the mean blocking
    time, total bytes, whether every rank succeeded. A rank's several rows of one checkpoint (a script's
    ``torch.save`` of the model, then of the optimizer: ``collectors.launch_checkpoints``) are summed first.
    Columns: ``SAVE_COLUMNS``."""
    require_columns(checkpoints, ["rank", "step", "kind", "blocking_ns", "async_ns", "total_ns", "num_bytes", "ok"],
                    table="checkpoints")
    c = checkpoints.dropna(subset=["step"])
    if c.empty:
        return pd.DataFrame({col: [] for col in SAVE_COLUMNS})
    c = c.assign(kind=c["kind"].fillna("save"))
    if c.duplicated(["step", "kind", "rank"]).any():
        sums = {col: (col, lambda x: x.astype("float64").sum(min_count=1))
                for col in ("blocking_ns", "async_ns", "total_ns", "num_bytes")}
        c = c.groupby(["step", "kind", "rank"], as_index=False).agg(
            **sums, ok=("ok", lambda x: bool(x.fillna(True).all())))
    rows = []
    for (step, kind), g in c.groupby(["step", "kind"], sort=True):
        blocking = g["blocking_ns"].astype("float64")
        if blocking.isna().all():
            blocking = g["total_ns"].astype("float64")
        slowest = int(g.loc[blocking.fillna(-1).idxmax(), "rank"])
        rows.append({
            "step": int(step), "kind": str(kind), "num_ranks": int(g["rank"].nunique()),
            "blocking_max_ns": float(blocking.max()), "blocking_mean_ns": float(blocking.mean()),
            "async_max_ns": float(g["async_ns"].astype("float64").max()),
            "total_max_ns": float(g["total_ns"].astype("float64").max()), "slowest_rank": slowest,
            "num_bytes": int(g["num_bytes"].fillna(0).sum()), "ok": bool(g["ok"].fillna(True).all()),
        })
    return pd.DataFrame(rows)[SAVE_COLUMNS]


def young_daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly optimal checkpoint interval sqrt(2 * C * MTBF) (seconds)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def checkpoint_summary(events: pd.DataFrame, *, wall_ns: float | None, step_ns: float | None,
                       mtbf_hours: float = DEFAULT_MTBF_HOURS, checkpoints: pd.DataFrame | None = None) -> dict:
    """Saves only: count, mean/max blocking (slowest rank), async share, blocking share of the wall time, current
    interval (steps and seconds), the Young/Daly interval for ``mtbf_hours``, and (with the raw ``checkpoints``
    table) each rank's mean blocking time. Plain JSON values."""
    saves = events[events["kind"] == "save"]
    if saves.empty:
        return {}
    cost_ns = float(saves["blocking_max_ns"].mean())
    blocked_ns = float(saves["blocking_max_ns"].sum())
    interval_steps = float(saves["step"].diff().dropna().mean()) if len(saves) > 1 else None
    interval_s = interval_steps * step_ns / 1e9 if interval_steps and step_ns else None
    yd_s = young_daly_interval_s(cost_ns / 1e9, mtbf_hours * 3600.0)
    async_total = float(saves["async_max_ns"].fillna(0).sum())
    return {
        "num_saves": int(len(saves)), "mean_blocking_ms": cost_ns / 1e6,
        "max_blocking_ms": float(saves["blocking_max_ns"].max()) / 1e6,
        "slowest_rank": int(saves.loc[saves["blocking_max_ns"].idxmax(), "slowest_rank"]),
        "async_ms_total": async_total / 1e6, "is_async": async_total > 0,
        "blocking_share_of_wall": blocked_ns / wall_ns if wall_ns else None,
        "interval_steps": interval_steps, "interval_s": interval_s,
        "mtbf_hours": mtbf_hours, "young_daly_interval_s": yd_s,
        "young_daly_interval_steps": yd_s * 1e9 / step_ns if step_ns else None,
        "all_ok": bool(saves["ok"].all()),
        "per_rank_blocking_ms": _per_rank_blocking_ms(checkpoints),
    }


def _per_rank_blocking_ms(checkpoints: pd.DataFrame | None) -> dict[str, float]:
    """rank -> mean blocking time of its saves (ms); {} without the raw table."""
    if checkpoints is None or checkpoints.empty:
        return {}
    saves = checkpoints[checkpoints["kind"].fillna("save") == "save"]
    blocking = saves["blocking_ns"].astype("float64").fillna(saves["total_ns"].astype("float64"))
    return {str(int(r)): float(v) / 1e6 for r, v in blocking.groupby(saves["rank"]).mean().items()}


def detect_checkpoint_stall(events: pd.DataFrame, summary: dict, *, warn_share: float = 0.05,
                            critical_share: float = 0.25, injected: dict[int, dict] | None = None,
                            world_size: int | None = None) -> list[Finding]:
    """CHECKPOINT_STALL when blocking checkpoint time is at least ``warn_share`` of the wall time (critical from
    ``critical_share``). Gain: moving to the Young/Daly interval (when saving more often than it) and/or async.
    When one rank of ``world_size`` alone saved (a whole-model ``torch.save`` under ``if rank == 0:``) the advice
    says so: its peers wait for it at their next collective, and the save can be spread over them."""
    share = summary.get("blocking_share_of_wall")
    if not summary or share is None or share < warn_share:
        return []
    cost_s = summary["mean_blocking_ms"] / 1e3
    yd = summary["young_daly_interval_s"]
    interval = summary["interval_s"]
    advice = []
    gain = None
    per_rank = summary.get("per_rank_blocking_ms") or {}
    top = max(per_rank.values()) if per_rank else 0.0
    ranks = tuple(int(r) for r, v in per_rank.items() if v >= 0.9 * top) or (summary["slowest_rank"],)
    if interval is not None and interval < yd:
        new_share = cost_s / yd
        gain = max(0.0, share - new_share)
        advice.append(f"Checkpoint every {yd:.0f} s (Young/Daly for MTBF {summary['mtbf_hours']:g} h) instead of "
                      f"every {interval:.1f} s: blocking share {share:.0%} -> {new_share:.1%}.")
    if not summary["is_async"]:
        advice.append("Use asynchronous saves (torch.distributed.checkpoint.async_save on its own process "
                      "group): only the staging copy blocks training.")
    if len(per_rank) == 1 and (world_size or 0) > 1:
        advice.append(f"Rank {ranks[0]} alone saves (a whole-model torch.save under `if rank == 0:`), and the "
                      f"other {world_size - 1} rank(s) wait for it at their next collective: let every rank write "
                      f"a part (torch.distributed.checkpoint.save spreads replicated tensors over the ranks), or "
                      f"copy the state to CPU and write it from a background thread.")
    elif len(ranks) == 1:
        advice.append(f"Rank {ranks[0]} blocks longest; check its storage path and bandwidth.")
    else:
        advice.append("Every rank blocks about as long (a collective save waits for its slowest writer): check the "
                      "storage bandwidth shared by the job.")
    return [Finding(
        code="CHECKPOINT_STALL", severity="critical" if share >= critical_share else "warning",
        ranks=ranks, group=None,
        title=(f"checkpoints block training {share:.0%} of the wall time ({summary['num_saves']} saves, "
               f"{summary['mean_blocking_ms']:.0f} ms blocking each on the slowest rank)"),
        evidence={**summary, "injected_slow_ckpt": {str(r): d for r, d in (injected or {}).items()} or None},
        recommendation=" ".join(advice),
        predicted_gain=PredictedGain(metric="wall_time", frac=gain) if gain else None,
        rows=events,
    )]
