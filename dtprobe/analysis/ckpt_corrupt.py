"""Checkpoints that failed validation on load (the runtime's ``corrupt-ckpt`` fault rows, ``injected=false``):
detector CHECKPOINT_CORRUPT. Read by the facade."""

from __future__ import annotations

import pandas as pd

from dtprobe.analysis.fault_detail import fault_detail, split_injected
from dtprobe.analysis.findings import Finding
from dtprobe.store.columns import require_columns


def detect_corrupt_checkpoints(faults: pd.DataFrame) -> list[Finding]:
    """CHECKPOINT_CORRUPT per corrupt checkpoint (path and step) the ranks found on load: warning when recovery
    fell back to an older checkpoint, critical when none was usable (``fallback_step`` null). Rows the fault
    injector wrote (``injected=true``) are only the ``injected`` cross-check."""
    if faults is None or faults.empty:
        return []
    require_columns(faults, ["rank", "time_ns", "step", "kind", "injected", "detail"], table="faults")
    rows = faults[faults["kind"] == "corrupt-ckpt"]
    if rows.empty:
        return []
    observed, injected = split_injected(rows)
    found: dict[tuple, dict] = {}
    for r in observed.sort_values("time_ns").itertuples(index=False):
        d = fault_detail(r.detail)
        key = (d.get("path"), d.get("ckpt_step"))
        f = found.setdefault(key, {"path": d.get("path"), "file": d.get("file"), "ckpt_step": d.get("ckpt_step"),
                                   "reason": d.get("reason"), "found_by": [], "fallback_step": d.get("fallback_step"),
                                   "first_ns": int(r.time_ns) if pd.notna(r.time_ns) else None})
        f["found_by"].append(int(r.rank))
        if f["fallback_step"] is None and d.get("fallback_step") is not None:
            f["fallback_step"] = d["fallback_step"]
        if f["file"] is None and d.get("file") is not None:
            f["file"] = d["file"]
    out = []
    for f in found.values():
        ranks = sorted(set(f["found_by"]))
        fallback = f["fallback_step"]
        recovery = (f"fell back to the checkpoint of step {fallback}" if fallback is not None
                    else "no usable checkpoint: the job cannot resume")
        step = f["ckpt_step"]
        lost = int(step) - int(fallback) if fallback is not None and step is not None else None
        out.append(Finding(
            code="CHECKPOINT_CORRUPT", severity="warning" if fallback is not None else "critical",
            ranks=tuple(ranks), group=None,
            title=(f"checkpoint of step {step} is corrupt ({f['file'] or f['path']}: {f['reason']}), found by "
                   f"rank(s) {ranks}; {recovery}"),
            evidence={"path": f["path"], "file": f["file"], "ckpt_step": step, "reason": f["reason"],
                      "found_by": ranks, "fallback_step": fallback, "steps_lost": lost,
                      "injected": bool(not injected.empty)},
            recommendation=("Check the storage the checkpoints are written to (disk errors, a full or flaky "
                            "filesystem, a copy interrupted); keep more than one checkpoint so a corrupt one "
                            "costs one interval, and verify checkpoints after writing them."),
            predicted_gain=None,
        ))
    return out
