"""AMP loss-scale metrics (overflow per step, rate, bursts, scale at its floor) and the AMP_OVERFLOW detector."""

from __future__ import annotations

import pandas as pd

from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.store.columns import require_columns

AMP_STEP_COLUMNS = ["step", "num_ranks", "overflow", "skipped", "overflow_ranks", "scale_before", "scale_after"]


def amp_steps(amp: pd.DataFrame) -> pd.DataFrame:
    """Per step: whether any rank overflowed (found_inf, or the scale dropped in ``update()``), whether the
    optimizer step was skipped, which ranks saw the inf, and the loss scale. Columns: ``AMP_STEP_COLUMNS``."""
    require_columns(amp, ["rank", "step", "scale_before", "scale_after", "found_inf", "skipped"], table="amp")
    a = amp.dropna(subset=["step"])
    if a.empty:
        return pd.DataFrame({col: [] for col in AMP_STEP_COLUMNS})
    a = a.assign(
        _inf=a["found_inf"].fillna(False).astype(bool)
        | (a["scale_after"].astype("float64") < a["scale_before"].astype("float64")).fillna(False),
        _skip=a["skipped"].fillna(False).astype(bool),
    )
    rows = []
    for step, g in a.groupby("step", sort=True):
        rows.append({
            "step": int(step), "num_ranks": int(g["rank"].nunique()), "overflow": bool(g["_inf"].any()),
            "skipped": bool(g["_skip"].any() or g["_inf"].any()),
            "overflow_ranks": ",".join(str(int(r)) for r in sorted(g.loc[g["found_inf"].fillna(False).astype(bool),
                                                                          "rank"].unique())),
            "scale_before": float(g["scale_before"].max()), "scale_after": float(g["scale_after"].min()),
        })
    return pd.DataFrame(rows)[AMP_STEP_COLUMNS]


def overflow_bursts(per_step: pd.DataFrame) -> list[tuple[int, int]]:
    """Runs of consecutive overflowing steps as (first, last) step pairs."""
    bursts: list[tuple[int, int]] = []
    for step, over in zip(per_step["step"], per_step["overflow"]):
        if not over:
            continue
        if bursts and bursts[-1][1] == step - 1:
            bursts[-1] = (bursts[-1][0], int(step))
        else:
            bursts.append((int(step), int(step)))
    return bursts


def detect_amp_overflow(per_step: pd.DataFrame, *, warn_rate: float = 0.05, warn_burst: int = 3,
                        scale_floor: float = 1.0, tail_steps: int = 10, critical_tail_rate: float = 0.5) -> list[Finding]:
    """AMP_OVERFLOW when any step overflowed. Critical when the scale sits at or below ``scale_floor`` or most of
    the last ``tail_steps`` steps overflow (training no longer progresses); warning for a rate of at least
    ``warn_rate`` or a burst of ``warn_burst`` steps; info otherwise (an occasional overflow is how dynamic
    loss scaling works). Gain: the steps wasted by skipping."""
    require_columns(per_step, AMP_STEP_COLUMNS, table="amp_steps")
    if per_step.empty or not per_step["overflow"].any():
        return []
    n = len(per_step)
    overflows = per_step[per_step["overflow"]]
    rate = len(overflows) / n
    bursts = overflow_bursts(per_step)
    longest = max(b - a + 1 for a, b in bursts)
    tail = per_step.tail(tail_steps)
    tail_rate = float(tail["overflow"].mean())
    final_scale = float(per_step["scale_after"].iloc[-1])
    min_scale = float(per_step["scale_after"].min())
    at_floor = min_scale <= scale_floor
    skipped_rate = float(per_step["skipped"].mean())
    if at_floor or tail_rate >= critical_tail_rate:
        severity = "critical"
    elif rate >= warn_rate or longest >= warn_burst:
        severity = "warning"
    else:
        severity = "info"
    ranks = sorted({int(r) for s in overflows["overflow_ranks"] for r in s.split(",") if r})
    advice = ("Occasional overflows are normal with dynamic loss scaling." if severity == "info" else
              "Train in bf16 (no loss scaling needed) if the hardware supports it; otherwise lower the initial "
              "scale / growth rate, clip gradients, and look for the layer producing inf/NaN (the overflow ranks "
              "and steps below) - a scale stuck at its floor means the model itself produces inf.")
    return [Finding(
        code="AMP_OVERFLOW", severity=severity, ranks=tuple(ranks), group=None,
        title=(f"{len(overflows)} of {n} steps overflowed in fp16 ({rate:.0%}), longest burst {longest}, "
               f"loss scale now {final_scale:g}" + (" (at its floor)" if at_floor else "")),
        evidence={
            "num_steps": n, "num_overflows": len(overflows), "overflow_rate": rate, "skipped_rate": skipped_rate,
            "bursts": [list(b) for b in bursts], "longest_burst": longest, "overflow_steps": overflows["step"].tolist(),
            "overflow_ranks": ranks, "final_scale": final_scale, "min_scale": min_scale,
            "scale_floor": scale_floor, "at_floor": at_floor, "tail_overflow_rate": tail_rate,
        },
        recommendation=advice,
        predicted_gain=PredictedGain(metric="wasted_steps", frac=skipped_rate) if severity != "info" else None,
        rows=per_step,
    )]
