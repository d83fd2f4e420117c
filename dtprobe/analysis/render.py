"""Renderings of the ``dtprobe.findings/1`` document (``RunAnalysis.report()``): text for a terminal (rich), Markdown,
JSON, and the header lines they share with the dashboard's Overview; read by ``dtprobe analyze`` and the dashboard.

Every function takes the document (plain JSON values), never the analysis: what is rendered is what ``--format
json`` prints.
"""

from __future__ import annotations

import json
from typing import Any

SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
"""rich style of each severity in the text rendering."""


def render_json(report: dict[str, Any]) -> str:
    """The document as indented JSON text (``dtprobe analyze --format json``)."""
    return json.dumps(report, indent=1) + "\n"


INTERRUPTED = ("the launcher was stopped (Ctrl-C or SIGTERM) and ended the workers of its last attempt, in which no "
               "rank had failed")
"""The header's line for ``metrics.run.interrupted`` (after ``interrupted: ``), also on the dashboard's Overview."""


def event_lines(report: dict[str, Any]) -> list[str]:
    """The header's crash and restart lines: every crash (its RANK_CRASH title), then every restart no crash line
    mentions, then whether the launcher was interrupted; shared by the text and Markdown renderers (the
    dashboard's Overview shows the same crash lines)."""
    run = report["metrics"]["run"]
    stopped = [f"interrupted: {INTERRUPTED}"] if run.get("interrupted") else []
    return [f"crash: {c['title']}" for c in run.get("crashes") or []] + restart_lines(run) + stopped


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
    if "collective_matching" in m:                     # a source whose ranks keep their own clocks
        facts.append(clock_fact(m))
    return facts


def clock_fact(m: dict[str, Any]) -> str:
    """One line on how a trace folder's clocks were aligned: from how many collectives, the largest offset and
    residual, who starts last most often; or why they were not."""
    how = m["run"].get("clock_aligned") or ""
    match = m["collective_matching"]
    if how != "device_collectives":
        return f"clocks: {how}"
    offsets, arrivals = m.get("clock_alignment") or [], m.get("arrivals") or []
    line = (f"clocks: aligned from {match['num_matched']} collectives matched by {match['method']}"
            f" ({match['num_refused']} refused); largest offset "
            f"{max(abs(o['offset_us'] or 0) for o in offsets):.1f} us, residual up to "
            f"{max(o['residual_us'] or 0 for o in offsets):.1f} us")
    if arrivals:
        from dtprobe.analysis.device_arrivals import MIN_MATCHED_COLLECTIVES   # pandas: not for the exporters

        last = max(arrivals, key=lambda r: (r["last_frac"], r["median_lateness_us"]))
        line += (f"; rank {last['rank']} starts last in {last['last_frac']:.0%} of its {last['pg']} "
                 f"collectives (median +{last['median_lateness_us']:.0f} us, device clock)")
        if last["num_collectives"] < MIN_MATCHED_COLLECTIVES:
            line += (f", too few to judge: STRAGGLER needs {MIN_MATCHED_COLLECTIVES} matched collectives of a "
                     f"group, it has {last['num_collectives']}")
    return line


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


def render_text(report: dict, console) -> None:
    """The report for a terminal: header, findings table by severity, recommendations, key metrics."""
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    m = report["metrics"]
    run = m["run"]
    head = [f"[bold]{report['source']}[/]  ({run['kind']}, status [bold]{run['status']}[/], "
            f"world size {run['world_size']})", *(f"[bold red]{escape(line)}[/]" for line in event_lines(report)),
            *summary_facts(report)]
    console.print(Panel("\n".join(head), title="dtprobe analyze", expand=False))
    findings = report["findings"]
    if not findings:
        console.print("[green]No findings.[/]")
    else:
        table = Table(title=f"{len(findings)} finding(s), worst first", show_lines=False)
        for col in ("severity", "code", "ranks", "group", "predicted gain"):
            table.add_column(col, no_wrap=True)
        for f in findings:
            gain = (f"{f['predicted_gain']['frac']:.0%} of {f['predicted_gain']['metric']}"
                    if f["predicted_gain"] else "")
            table.add_row(f"[{SEVERITY_STYLE[f['severity']]}]{f['severity']}[/]", f["code"],
                          ",".join(map(str, f["ranks"])), f["group"] or "", gain)
        console.print(table)
        for f in findings:
            console.print(f"[{SEVERITY_STYLE[f['severity']]}]{f['code']}[/]: {f['title']}")
            console.print(f"  [bold]->[/] {f['recommendation']}", highlight=False)
    if m.get("temporal_breakdown"):
        t = Table(title="temporal breakdown (GPU kernels)")
        for col in ("rank", "idle", "compute", "non-compute", "kernel time (us)", "comm overlap"):
            t.add_column(col, justify="right")
        overlap = {r["rank"]: r["overlap_frac"] for r in m.get("comm_comp_overlap", [])}
        for r in m["temporal_breakdown"]:
            t.add_row(str(r["rank"]), _pct(r["idle_frac"]), _pct(r["compute_frac"]), _pct(r["non_compute_frac"]),
                      f"{r['kernel_time_us']:,}", _pct(overlap.get(r["rank"])))
        console.print(t)
    if m.get("comm_exposure"):
        t = Table(title="communication per rank (host estimate, share of step)")
        for col in ("rank", "comm", "exposed", "straggler wait", "overlap"):
            t.add_column(col, justify="right")
        for r in m["comm_exposure"]:
            t.add_row(str(r["rank"]), _pct(r["comm_frac"]), _pct(r["exposed_frac"]), _pct(r["straggler_wait_frac"]),
                      _pct(r["overlap_frac"]))
        console.print(t)
