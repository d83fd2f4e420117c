"""The ``dtprobe.findings/1`` document: its ``metrics`` object and the document itself; read by
``RunAnalysis.metrics``/``report`` (renderings of the document are in ``render``).

``build_metrics`` reads an analysis through ``MetricsInputs``, the methods of ``RunAnalysis`` it calls, so this
module does not import the facade (which imports it).
"""

from __future__ import annotations

from typing import Any, Protocol

import pandas as pd

from dtprobe.analysis.bubble import PipelineShape, ideal_bubble
from dtprobe.analysis.crashes import crash_entries, restart_summary
from dtprobe.analysis.findings import Finding, jsonable
from dtprobe.store.source import SourceInfo

SCHEMA = "dtprobe.findings/1"
"""Value of the ``schema`` key of the JSON document."""


class MetricsInputs(Protocol):
    """What ``build_metrics`` and ``run_events`` read of an analysis (``RunAnalysis`` has all of it)."""

    @property
    def info(self) -> SourceInfo: ...
    @property
    def status(self) -> str: ...
    @property
    def world_size(self) -> int | None: ...
    @property
    def skipped_warmup_steps(self) -> int: ...
    def layout(self) -> dict: ...
    def steps_analyzed(self) -> list[int]: ...
    def step_time_ns(self) -> float | None: ...
    def throughput_summary(self) -> dict: ...
    def temporal_breakdown(self) -> pd.DataFrame: ...
    def comm_comp_overlap(self) -> pd.DataFrame: ...
    def kernel_breakdown(self) -> pd.DataFrame: ...
    def exposure_by_rank(self) -> pd.DataFrame: ...
    def straggler_scores(self) -> pd.DataFrame: ...
    def collective_bandwidth(self) -> pd.DataFrame: ...
    def bandwidth_by_size(self) -> pd.DataFrame: ...
    def bandwidth_fit(self) -> tuple[float, float] | None: ...
    def bubble_by_rank(self) -> pd.DataFrame: ...
    def pipeline_shape(self) -> PipelineShape | None: ...
    def amp_steps(self) -> pd.DataFrame: ...
    def checkpoint_summary(self) -> dict: ...
    def compression(self) -> pd.DataFrame: ...
    def loss_gap(self) -> pd.DataFrame: ...
    def device_health(self) -> pd.DataFrame: ...
    def hangs(self) -> list[Finding]: ...
    def mismatch_findings(self) -> list[Finding]: ...
    def crash_events(self) -> pd.DataFrame: ...
    def restarts(self) -> list[dict]: ...
    def attempts(self) -> list[dict]: ...
    def clock_alignment(self) -> str: ...
    def clock_resync(self) -> pd.DataFrame: ...
    def arrival_clock(self) -> str | None: ...
    def clock_offsets(self) -> pd.DataFrame: ...
    def arrival_summary(self) -> pd.DataFrame: ...
    def collective_matching(self) -> dict: ...
    def group_coverage(self) -> pd.DataFrame: ...
    def matching_method(self) -> str: ...


def document(*, source: str, metrics: dict[str, Any], findings: list[Finding]) -> dict[str, Any]:
    """The ``dtprobe.findings/1`` document: schema, source, metrics, findings (plain JSON values)."""
    return jsonable({"schema": SCHEMA, "source": source, "metrics": metrics,
                     "findings": [f.to_json() for f in findings]})


def _records(df: pd.DataFrame, columns: list[str] | None = None) -> list[dict[str, Any]]:
    if df is None or df.empty:
        return []
    if columns:
        df = df[[c for c in columns if c in df.columns]]
    return jsonable(df.to_dict(orient="records"))


def build_metrics(a: MetricsInputs) -> dict[str, Any]:
    """Key metrics of the run: source facts, steps analysed, step time, throughput/MFU, per-rank temporal breakdown
    and overlap (when kernels are known), communication exposure, straggler scores, collectives by size,
    pipeline bubble, AMP, checkpoints, compression, device health."""
    steps = a.steps_analyzed()
    info = a.info
    m: dict[str, Any] = {
        "run": {
            "kind": info.kind, "run_id": info.run_id,
            "status": a.status, "world_size": a.world_size, "layout": a.layout() or None,
            "clock_aligned": a.clock_alignment(),
            **({"clock_resync": resync} if (resync := _records(a.clock_resync())) else {}),
            "arrival_clock": a.arrival_clock(),
            **run_events(a),
        },
        "steps_analyzed": {"first": steps[0] if steps else None, "last": steps[-1] if steps else None,
                           "count": len(steps), "skipped_warmup_steps": a.skipped_warmup_steps},
        "step_time_ms": a.step_time_ns() / 1e6 if a.step_time_ns() else None,
        "throughput": a.throughput_summary() or None,
    }
    temporal = a.temporal_breakdown()
    if not temporal.empty:
        m["temporal_breakdown"] = _records(temporal, ["rank", "idle_frac", "compute_frac", "non_compute_frac",
                                                      "kernel_time_us"])
        m["comm_comp_overlap"] = _records(a.comm_comp_overlap(), ["rank", "overlap_frac"])
        m["kernel_type_breakdown"] = _records(a.kernel_breakdown())
    exposure = a.exposure_by_rank()
    if not exposure.empty:
        m["comm_exposure"] = _records(exposure)
    scores = a.straggler_scores() if info.clock_aligned else pd.DataFrame()
    if not scores.empty:
        worst = scores.sort_values("median_lateness_frac", ascending=False).drop_duplicates(["pg", "pg_ranks"])
        m["latest_rank_by_group"] = _records(worst, ["pg", "pg_ranks", "rank", "num_steps", "median_lateness_frac",
                                                     "positive_frac", "last_frac"])
    if not info.clock_aligned:
        m.update(device_clock_metrics(a))
    bw = a.bandwidth_by_size()
    if not bw.empty:
        fit = a.bandwidth_fit()
        m["collectives"] = {
            "num_collectives": int(len(a.collective_bandwidth())),
            "latency_us": fit[0] / 1e3 if fit else None, "bandwidth_gbps": fit[1] * 8 / 1e9 if fit else None,
            "by_op_size": _records(bw),
        }
    bubble = a.bubble_by_rank()
    shape = a.pipeline_shape()
    if not bubble.empty and shape is not None:
        m["pipeline"] = {"schedule": shape.schedule, "num_microbatches": shape.num_microbatches,
                         "num_stages": shape.num_stages, "ideal_bubble_frac": ideal_bubble(shape)[0],
                         "per_rank": _records(bubble, ["rank", "stages", "bubble_frac"])}
    amp = a.amp_steps()
    if not amp.empty:
        m["amp"] = {"num_steps": int(len(amp)), "num_overflows": int(amp["overflow"].sum()),
                    "final_scale": float(amp["scale_after"].iloc[-1])}
    if a.checkpoint_summary():
        m["checkpoints"] = a.checkpoint_summary()
    comp = a.compression()
    if not comp.empty:
        m["compression"] = _records(comp)
        gap = a.loss_gap()
        if not gap.empty:
            m["loss_gap"] = _records(gap)[0]
    health = a.device_health()
    if not health.empty:
        m["devices"] = _records(health)
    return jsonable(m)


def device_clock_metrics(a: MetricsInputs) -> dict[str, Any]:
    """For a source whose ranks keep their own clocks: ``collective_matching`` (method, matched, refused by
    reason, groups not judged and why), ``clock_alignment`` (per rank: offset_us onto the lowest rank's clock,
    residual_us, num_collectives) and ``arrivals`` (per rank and group: num_collectives, last_frac,
    median_lateness_us on the device clock)."""
    offsets = a.clock_offsets()
    arrivals = a.arrival_summary()
    return {
        "collective_matching": a.collective_matching(),
        "clock_alignment": _records(offsets, ["rank", "offset_us", "residual_us", "num_collectives"]),
        "arrivals": [dict(r, pg_ranks=[int(x) for x in str(r["pg_ranks"]).split(",") if x])
                     for r in _records(arrivals, ["rank", "pg", "pg_ranks", "num_collectives", "last_frac",
                                                  "median_lateness_us"])],
    }


def run_events(a: MetricsInputs) -> dict[str, Any]:
    """``crashes`` (``crashes.crash_entries``: one per RANK_CRASH finding, then one per failed attempt whose first
    failure a HANG or COLLECTIVE_MISMATCH explains) and ``restarts`` (restart, time_ns, from_step, checkpoint_step,
    steps_lost) of ``metrics.run``, empty lists for a source without either (a trace folder has neither); and
    ``interrupted``: the launcher stopped the job's last attempt on an interrupt (``interrupted_attempt``)."""
    crashes = crash_entries(a.crash_events(), a.hangs() + a.mismatch_findings())
    return {"crashes": crashes, "restarts": restart_summary(a.restarts()),
            "interrupted": interrupted_attempt(a.attempts(), status=a.status)}


def interrupted_attempt(attempts: list[dict], *, status: str) -> bool:
    """True when the run is over and every node's record of its last attempt says ``interrupted`` (its workers
    stopped without a failure: Ctrl-C or SIGTERM to the launcher); a failure on any node makes it False."""
    if status == "running" or not attempts:
        return False
    last = max(int(x.get("attempt") or 0) for x in attempts)
    return all(x.get("result") == "interrupted" for x in attempts if int(x.get("attempt") or 0) == last)
