"""Probe overhead: what dtprobe's collectors and its runtime cost per training step, measured side by side.

    python benchmarks/probe_overhead.py [--nproc 2] [--steps 100] [--pairs 3]

Two ratios of median step time, each from runs alternated in one invocation (A B A B ...) so that drift of
the shared machine hits both sides alike:

1. collectors on / off: `dtprobe run` with its default telemetry (every collective recorded by the wrapping
   ProcessGroup, host/NVML sampler, steps) against `dtprobe run --no-collectives --no-devices` (only the steps
   table, which both sides need to time the step). Goal <= 1.01.
2. runtime / plain: `dtprobe run --no-collectives --no-devices` against benchmarks/plain_ddp.py, a 30-line
   torchrun DDP script of the same model, batch and optimizer, timed the same way (data, forward, backward,
   clip, optimizer, loss.item()). Goal <= 1.02.

The first `--skip` steps of every run are left out (DDP rebuilds its buckets after step 0). Figures are CPU/gloo
figures of this machine, not GPU ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def dtprobe_run(run_dir: Path, *, nproc: int, steps: int, collect: bool) -> list[float]:
    cmd = [sys.executable, "-m", "dtprobe.cli", "run", "--nproc", str(nproc), "--steps", str(steps),
           "--run-dir", str(run_dir), "--warmup", "0"]
    if not collect:
        cmd += ["--no-collectives", "--no-devices"]
    subprocess.run(cmd, check=True, env=_env(), timeout=900, stdout=subprocess.DEVNULL)
    from dtprobe.store import RunStore

    steps_df = RunStore.open(run_dir).table("steps")
    leader = steps_df[steps_df["rank"] == 0].sort_values("step")
    return ((leader["end_ns"] - leader["start_ns"]).astype("float64") / 1e9).tolist()


def plain_run(out: Path, *, nproc: int, steps: int) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "benchmarks" / "plain_ddp.py"), "--steps", str(steps), "--out", str(out)]
    subprocess.run(cmd, check=True, env=_env(), timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())["step_s"]


def median_after(times: list[float], skip: int) -> float:
    return statistics.median(times[skip:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run (default 2: one per core)")
    parser.add_argument("--steps", type=int, default=100, help="steps per run (default 100)")
    parser.add_argument("--pairs", type=int, default=3, help="alternated pairs per comparison (default 3)")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of each run (default 5)")
    args = parser.parse_args()

    medians: dict[str, list[float]] = {"on": [], "off": [], "plain": []}
    with tempfile.TemporaryDirectory(prefix="dtprobe-bench-") as tmp:
        tmp_path = Path(tmp)
        for i in range(args.pairs):
            for name in ("on", "off", "plain"):
                if name == "plain":
                    times = plain_run(tmp_path / f"plain{i}.json", nproc=args.nproc, steps=args.steps)
                else:
                    times = dtprobe_run(tmp_path / f"{name}{i}", nproc=args.nproc, steps=args.steps,
                                        collect=name == "on")
                medians[name].append(median_after(times, args.skip))
                print(f"pair {i + 1}/{args.pairs} {name:>5}: median step {medians[name][-1] * 1e3:7.2f} ms",
                      flush=True)

    on, off, plain = (statistics.median(medians[k]) for k in ("on", "off", "plain"))
    pair_collect = [a / b for a, b in zip(medians["on"], medians["off"])]
    pair_runtime = [a / b for a, b in zip(medians["off"], medians["plain"])]
    print()
    print(f"median step (ms): collectors on {on * 1e3:.2f}, off {off * 1e3:.2f}, plain DDP script {plain * 1e3:.2f}")
    print(f"collectors on/off ratio:   {statistics.median(pair_collect):.3f}  (per pair: "
          f"{', '.join(f'{r:.3f}' for r in pair_collect)}; goal <= 1.01)")
    print(f"runtime/plain ratio:       {statistics.median(pair_runtime):.3f}  (per pair: "
          f"{', '.join(f'{r:.3f}' for r in pair_runtime)}; goal <= 1.02)")
    print(f"({args.nproc} ranks x {args.steps} steps per run, CPU + gloo on this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
