"""The ``metrics`` object of the ``dtprobe.findings/1`` document and its Markdown rendering; read by
``RunAnalysis.metrics`` and ``dtprobe analyze --format md`` (text rendering with rich lives in the command)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

from dtprobe.analysis.findings import jsonable

if TYPE_CHECKING:
    from dtprobe.analysis.facade import RunAnalysis


def _records(df: pd.DataFrame, columns: list[str] | None = None) -> list[dict[str, Any]]:
    if df is None or df.empty:
        return []
    if columns:
        df = df[[c for c in columns if c in df.columns]]
    return jsonable(df.to_dict(orient="records"))


def build_metrics(a: "RunAnalysis") -> dict[str, Any]:
    """Key metrics of the run: source facts, steps analysed, step time, throughput/MFU, per-rank temporal breakdown
    and overlap (when kernels are known), communication exposure, straggler scores, collectives by size,
    pipeline bubble, AMP, checkpoints, compression, device health."""
    steps = a.steps_analyzed()
    m: dict[str, Any] = {
        "run": {
            "kind": "kineto_traces" if a.is_trace_folder else "dtprobe_run",
            "run_id": a.manifest.run_id if a.manifest is not None else None,
            "status": a.status, "world_size": a.world_size, "layout": a.layout() or None,
            "clock_aligned": not a.is_trace_folder,
            **run_events(a),
        },
        "steps_analyzed": {"first": steps[0] if steps else None, "last": steps[-1] if steps else None,
                           "count": len(steps),
                           "skipped_warmup_steps": 0 if a.is_trace_folder else a.options.skip_first_steps},
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
    scores = a.straggler_scores()
    if not scores.empty and not a.is_trace_folder:
        worst = scores.sort_values("median_lateness_frac", ascending=False).drop_duplicates(["pg", "pg_ranks"])
        m["latest_rank_by_group"] = _records(worst, ["pg", "pg_ranks", "rank", "num_steps", "median_lateness_frac",
                                                     "positive_frac", "last_frac"])
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
        from dtprobe.analysis.bubble import ideal_bubble

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


def run_events(a: "RunAnalysis") -> dict[str, list[dict[str, Any]]]:
    """``crashes`` (one per RANK_CRASH finding: rank, restart, step, cause, how, recovered, resumed_from_step,
    steps_lost, time_to_recover_s, title) and ``restarts`` (restart, time_ns, from_step, checkpoint_step,
    steps_lost) of ``metrics.run``; empty lists for a trace folder or a run without either."""
    if a.is_trace_folder:
        return {"crashes": [], "restarts": []}
    from dtprobe.analysis.crashes import restart_summary

    crashes = [{"rank": f.ranks[0], **{k: f.evidence.get(k) for k in (
                   "restart", "step", "cause", "signal", "exit_code", "error_type", "recovered", "resumed_from_step",
                   "steps_lost", "time_to_recover_s")}, "title": f.title}
               for f in a.hangs() if f.code == "RANK_CRASH"]
    return {"crashes": crashes, "restarts": restart_summary(a.restarts())}


def event_lines(report: dict[str, Any]) -> list[str]:
    """The header's crash and restart lines: every crash (its RANK_CRASH title), then every restart no crash line
    mentions; shared by the text and Markdown renderers (the dashboard's Overview shows the same crash lines)."""
    run = report["metrics"]["run"]
    return [f"crash: {c['title']}" for c in run.get("crashes") or []] + restart_lines(run)


def restart_lines(run: dict[str, Any]) -> list[str]:
    """One line per restart of ``metrics.run`` that no crash title already tells (a recovered crash names the
    restart that followed it), e.g. a restart after a hang."""
    told = {int(c["restart"]) + 1 for c in run.get("crashes") or [] if c.get("recovered")}
    lines = []
    for r in run.get("restarts") or []:
        if int(r["restart"]) not in told:
            bits = [f"from step {r['from_step']}" if r.get("from_step") is not None else None,
                    f"{r['steps_lost']} step(s) lost" if r.get("steps_lost") is not None else None]
            lines.append(f"restart {r['restart']}: the job restarted " + ", ".join(b for b in bits if b))
    return lines


def summary_facts(report: dict[str, Any]) -> list[str]:
    """The run's headline facts as plain lines (steps analysed, median step time, throughput and MFU), shared by
    the text and Markdown renderers; a fact the run lacks is left out."""
    m = report["metrics"]
    sa = m["steps_analyzed"]
    facts = []
    if sa["count"]:
        facts.append(f"steps analysed: {sa['first']}..{sa['last']} ({sa['count']} steps, first "
                     f"{sa['skipped_warmup_steps']} skipped as warm-up)")
    if m.get("step_time_ms"):
        facts.append(f"median step time: {m['step_time_ms']:.1f} ms")
    tp = m.get("throughput") or {}
    if tp.get("tokens_per_s"):
        mfu = f"{tp['mfu']:.1%}" if tp.get("mfu") is not None else f"n/a ({tp.get('mfu_reason')})"
        facts.append(f"throughput: {tp['tokens_per_s']:,.0f} tokens/s, MFU {mfu}")
    return facts


def render_markdown(report: dict[str, Any]) -> str:
    """The document as Markdown: a findings table by severity, then each finding, then key metrics."""
    m = report["metrics"]
    run = m["run"]
    lines = [f"# dtprobe analysis of `{report['source']}`", ""]
    lines.append(f"- source: {run['kind']}, status **{run['status']}**, world size {run['world_size']}")
    lines += [f"- **{line}**" for line in event_lines(report)]
    lines += [f"- {fact}" for fact in summary_facts(report)]
    lines += ["", "## Findings", ""]
    findings = report["findings"]
    if not findings:
        lines.append("No findings.")
    else:
        lines += ["| severity | code | ranks | group | title | predicted gain |", "|---|---|---|---|---|---|"]
        for f in findings:
            gain = (f"{f['predicted_gain']['frac']:.0%} {f['predicted_gain']['metric']}"
                    if f["predicted_gain"] else "")
            lines.append(f"| {f['severity']} | {f['code']} | {', '.join(map(str, f['ranks']))} | "
                         f"{f['group'] or ''} | {f['title']} | {gain} |")
        for f in findings:
            lines += ["", f"### {f['code']} ({f['severity']}): {f['title']}", "", f"**Recommendation.** "
                      f"{f['recommendation']}", "", "Evidence:", ""]
            for k, v in f["evidence"].items():
                if isinstance(v, list) and v and isinstance(v[0], dict):
                    v = f"{len(v)} rows"
                lines.append(f"- `{k}`: {v}")
    if m.get("temporal_breakdown"):
        lines += ["", "## Temporal breakdown", "", "| rank | idle | compute | non-compute | kernel time (us) |",
                  "|---|---|---|---|---|"]
        for r in m["temporal_breakdown"]:
            lines.append(f"| {r['rank']} | {_pct(r['idle_frac'])} | {_pct(r['compute_frac'])} | "
                         f"{_pct(r['non_compute_frac'])} | {r['kernel_time_us']} |")
    if m.get("comm_exposure"):
        lines += ["", "## Communication exposure (host estimate)", "",
                  "| rank | comm | exposed | straggler wait | overlap |", "|---|---|---|---|---|"]
        for r in m["comm_exposure"]:
            lines.append(f"| {r['rank']} | {_pct(r['comm_frac'])} | {_pct(r['exposed_frac'])} | "
                         f"{_pct(r['straggler_wait_frac'])} | {_pct(r['overlap_frac'])} |")
    return "\n".join(lines) + "\n"


def _pct(x: Any) -> str:
    return "" if x is None else f"{x:.1%}"
