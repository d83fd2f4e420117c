"""``dtprobe plan``: rank parallel layouts for a model on a cluster, and calibrate the model from a measured run.

Example: ``dtprobe plan --model llama3-70b --gpus 512 --gpu a100-80 --gpus-per-node 8 --seq-len 8192
--global-batch 1024``; ``dtprobe plan --calibrate runs/dp4`` (predicted vs measured for that run's layout).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dtprobe.catalog import BUILTIN_MODELS, DEVICES, PUBLISHED_MODELS

_EPILOG = (f"model presets: {' '.join(BUILTIN_MODELS)} (dtprobe's built-in GPT), {' '.join(PUBLISHED_MODELS)}\n"
           f"gpu presets:   {' '.join(n for n, d in DEVICES.items() if not d.is_cpu)} (datasheet dense peaks), "
           f"{' '.join(n for n, d in DEVICES.items() if d.is_cpu)} (declared CPU figures)\n") + """\
output: text (a table), or --format json: {"schema": "dtprobe.plan/1", "layouts": [...best first...],
        "rejected": [...with "reason"...]} (see docs/planner.md)
calibration: --calibrate RUN refits compute efficiency, bus bandwidth, latency and DP overlap from a run made
        by `dtprobe run` and prints predicted vs measured for its layout; add --model to plan with the refit values.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="rank DP x TP x PP x ZeRO layouts by memory and predicted step time; calibrate from a run",
        description="Search every valid layout (dp, tp, pp, ZeRO stage, micro-batch, gradient accumulation, "
                    "recompute, pipeline schedule, virtual stages) of a model on a cluster: memory per GPU "
                    "(Korthikanti et al. activations), predicted step time (compute, TP/DP/PP communication on "
                    "an alpha-beta topology model, the pipeline bubble from dtprobe's schedule simulator) and the "
                    "top K that fit, each with why it beats the next.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and cluster")
    g.add_argument("--model", help="model preset (see below)")
    g.add_argument("--gpus", type=int, help="total GPUs (default: --gpus-per-node, one node)")
    g.add_argument("--gpu", help="device preset (default h100-80; with --calibrate, the device the run used)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node / NVLink domain (default 8)")
    g.add_argument("--gpu-memory-gib", type=float, help="override the preset's device memory")
    g.add_argument("--intra-bw", type=float, metavar="GB/S", help="per-GPU intra-node bandwidth per direction")
    g.add_argument("--inter-bw", type=float, metavar="GB/S", help="per-GPU network bandwidth per direction")
    g.add_argument("--intra-latency-us", type=float, help="intra-node latency per hop (default 5)")
    g.add_argument("--inter-latency-us", type=float, help="inter-node latency per hop (default 10)")
    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    g.add_argument("--global-batch", type=int, help="sequences per optimizer step (default 2 x --gpus)")
    g.add_argument("--precision", default=None, choices=("fp32", "bf16", "fp16", "fp8"),
                   help="compute precision (default bf16; fp32 on the cpu preset)")
    g.add_argument("--optimizer", default="adam", choices=("adam", "sgd"), help="default adam")
    g.add_argument("--memory-margin", type=float, default=0.10, metavar="FRAC",
                   help="share of device memory kept free (default 0.10)")
    g.add_argument("--no-sequence-parallel", action="store_true", help="TP without sequence parallelism")
    g = p.add_argument_group("output and calibration")
    g.add_argument("--top", type=int, default=5, metavar="K", help="layouts to show (default 5)")
    g.add_argument("--format", choices=("text", "json"), default="text", help="default text")
    g.add_argument("--rejected", type=int, default=3, metavar="N", help="rejected layouts listed in text (default 3)")
    g.add_argument("--calibrate", metavar="RUN", help="refit the model from this run directory")
    g.add_argument("--warmup-steps", type=int, default=3, help="steps skipped when calibrating (default 3)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from dtprobe.planner import TrainingSpec, device_preset, make_cluster, model_preset, plan
    from dtprobe.store.errors import ConfigError

    cal = None
    if args.calibrate:
        cal = _calibrate(args)
        if not args.model:
            if args.format == "json":
                print(json.dumps(_calibration_json(cal), indent=2))
            else:
                _print_calibration(cal)
            return 0
    if not args.model:
        raise ConfigError("--model is required (e.g. --model llama3-70b), unless you only --calibrate RUN")
    gpu = args.gpu or (cal.setup.cluster.device.name if cal is not None else "h100-80")
    if cal is not None and cal.setup.cluster.device.is_cpu != device_preset(gpu).is_cpu:
        raise ConfigError(f"the calibration comes from a {'CPU' if cal.setup.cluster.device.is_cpu else 'GPU'} run "
                          f"and --gpu {gpu} is not: its efficiencies do not transfer. Plan with --gpu "
                          f"{cal.setup.cluster.device.name}, or calibrate from a run on {gpu}.")
    gpus = args.gpus or args.gpus_per_node
    model = model_preset(args.model)
    cluster = make_cluster(gpu=gpu, num_gpus=gpus, gpus_per_node=args.gpus_per_node,
                           intra_bw_gb_s=args.intra_bw, inter_bw_gb_s=args.inter_bw,
                           intra_latency_us=args.intra_latency_us, inter_latency_us=args.inter_latency_us,
                           memory_gib=args.gpu_memory_gib)
    precision = args.precision or ("fp32" if cluster.device.is_cpu else "bf16")
    training = TrainingSpec(global_batch=args.global_batch or 2 * gpus, seq_len=args.seq_len or model.seq_len,
                            precision=precision, optimizer=args.optimizer, memory_margin_frac=args.memory_margin,
                            sequence_parallel=not args.no_sequence_parallel)
    t0 = time.perf_counter()
    result = plan(model, cluster, training, top_k=args.top, efficiency=cal.efficiency if cal else None)
    elapsed = time.perf_counter() - t0
    if args.format == "json":
        doc = result.to_json_dict()
        if cal is not None:
            doc["calibration"] = _calibration_json(cal)
        print(json.dumps(doc, indent=2))
        return 0
    if cal is not None:
        _print_calibration(cal)
    _print_plan(result, elapsed=elapsed, num_rejected=args.rejected)
    return 0


def _calibrate(args: argparse.Namespace):
    from rich.console import Console

    from dtprobe.planner import device_preset
    from dtprobe.planner.calibrate import calibrate
    from dtprobe.store import RunStore

    with Console(stderr=True).status(f"calibrating from {args.calibrate} ..."):
        store = RunStore.open(args.calibrate)
        kinds = {str(r.device).split(":")[0] for r in store.manifest.ranks}
        device = device_preset(args.gpu) if args.gpu is not None else None
        device = None if kinds <= {"cpu"} else device
        return calibrate(store, device=device, warmup_steps=args.warmup_steps)


def _calibration_json(cal) -> dict:
    import dataclasses

    rows = cal.comparison.astype(object).where(cal.comparison.notna(), None).to_dict(orient="records")
    return {"schema": "dtprobe.calibration/1", "run_id": cal.run_id, "layout": cal.setup.layout,
            "device": cal.setup.cluster.device.name, "device_is_cpu": cal.setup.cluster.device.is_cpu,
            "latency_s": cal.setup.cluster.device.intra_latency_s,
            "efficiency": dataclasses.asdict(cal.efficiency), "num_steps": cal.num_steps,
            "comparison": rows, "notes": list(cal.notes)}


def _print_calibration(cal) -> None:
    from rich.console import Console
    from rich.table import Table

    from dtprobe.planner import describe

    console = Console()
    dev = cal.setup.cluster.device
    kind = "CPU figures" if dev.is_cpu else "GPU"
    e = cal.efficiency
    console.print(f"[bold]calibration from run {cal.run_id}[/] ({describe(cal.setup.layout)}, "
                  f"{cal.setup.model.name}, device preset {dev.name}: {kind}; {cal.num_steps} steps)")
    console.print(f"  compute efficiency {e.compute:.3f} of {dev.peak(cal.setup.training.precision) / 1e9:.0f} "
                  f"GFLOP/s declared; bus bandwidth {e.bw_intra * dev.intra_bw_bytes_per_s / 1e9:.2f} GB/s, latency "
                  f"{dev.intra_latency_s * 1e6:.0f} us; DP overlap {e.dp_overlap:.2f}; host overhead "
                  f"{e.overhead_s * 1e3:.1f} ms"
                  + (f"; pipeline hop {e.p2p_latency_s * 1e3:.2f} ms" if e.p2p_latency_s is not None else ""))
    table = Table("term", "predicted ms", "measured ms", "error")
    for r in cal.comparison.itertuples(index=False):
        measured = "-" if r.measured_s != r.measured_s else f"{r.measured_s * 1e3:.2f}"
        err = "-" if r.error_frac != r.error_frac else f"{r.error_frac:+.1%}"
        table.add_row(r.term, f"{r.predicted_s * 1e3:.2f}", measured, err)
    console.print(table)
    for note in cal.notes:
        console.print(f"  note: {note}")


def _print_plan(result, *, elapsed: float, num_rejected: int) -> None:
    from rich.console import Console

    from dtprobe.planner import describe

    console = Console()
    c, t = result.cluster, result.training
    dev = c.device
    console.print(f"[bold]{result.model.name}[/] on {c.world_size} x {dev.name}"
                  f"{' (CPU figures)' if dev.is_cpu else ''} ({c.num_nodes} nodes x {c.gpus_per_node}), "
                  f"seq {t.seq_len}, global batch {t.global_batch}, {t.precision} {t.optimizer}")
    usable = dev.memory_gib * (1 - t.memory_margin_frac)
    console.print(f"{result.num_candidates} layouts evaluated in {elapsed:.2f} s; {result.num_fit} fit in "
                  f"{usable:.1f} GiB ({dev.memory_gib:g} GiB - {t.memory_margin_frac:.0%} margin)")
    if result.layouts.empty:
        console.print("[red]no layout fits[/]")
    labels = {"compute_s": "compute", "recompute_s": "recompute", "tp_comm_s": "TP", "dp_sync_s": "DP",
              "zero3_gather_s": "ZeRO-3", "pp_p2p_s": "p2p", "bubble_s": "bubble", "optimizer_s": "opt",
              "overhead_s": "host"}
    for r in result.layouts.to_dict(orient="records"):
        console.print(f"[bold]#{r['rank']}  {describe(r)}[/]   {r['step_time_s']:.3f} s/step  "
                      f"{r['tokens_per_s']:,.0f} tok/s  MFU {r['mfu_frac']:.1%}  {r['total_gib']:.1f} GiB",
                      highlight=False)
        terms = "  ".join(f"{label} {r[k]:.3f}" for k, label in labels.items() if r[k] > 0)
        console.print(f"    seconds: {terms}", highlight=False)
        console.print(f"    why: {r['why']}", highlight=False)
    rej = result.rejected
    if not rej.empty:
        console.print(f"{len(rej)} layouts do not fit; closest:")
        for r in rej.head(num_rejected).to_dict(orient="records"):
            console.print(f"  {describe(r)}: {r['reason']}")
        plain = rej[(rej["tp"] == 1) & (rej["pp"] == 1) & (rej["zero"] == 0)]
        if not plain.empty:
            console.print(f"  plain data parallel ({describe(plain.iloc[0])}): {plain.iloc[0]['reason']}")
    sys.stdout.flush()
