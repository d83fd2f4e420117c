"""Planner speed: the full layout search for LLaMA-3 70B on 512 A100-80GB (goal: at most 1 s).

Run: ``python benchmarks/planner_speed.py [--repeat 5]``. Prints the cold search (pipeline-simulation cache
empty, as in a fresh ``dtprobe plan``), the warm search (cache filled), and their ratio to the 1 s goal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from dtprobe.planner import TrainingSpec, make_cluster, model_preset, plan
from dtprobe.planner.pipeline import _simulated, clear_caches

GOAL_S = 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions of each (default 5)")
    args = parser.parse_args()
    model = model_preset("llama3-70b")
    cluster = make_cluster(gpu="a100-80", num_gpus=512, gpus_per_node=8)
    training = TrainingSpec(global_batch=1024, seq_len=8192, precision="bf16", optimizer="adam")
    cold, warm, cold_cpu, warm_cpu = [], [], [], []
    for _ in range(args.repeat):
        clear_caches()
        t0, c0 = time.perf_counter(), time.process_time()
        result = plan(model, cluster, training, top_k=5)
        cold.append(time.perf_counter() - t0)
        cold_cpu.append(time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        plan(model, cluster, training, top_k=5)
        warm.append(time.perf_counter() - t0)
        warm_cpu.append(time.process_time() - c0)
    sims = _simulated.cache_info().currsize
    print(f"llama3-70b on 512 x a100-80: {result.num_candidates} layouts, {result.num_fit} fit, "
          f"{sims} pipeline simulations")
    for name, xs, cpu in (("cold", cold, cold_cpu), ("warm", warm, warm_cpu)):
        med = statistics.median(xs)
        print(f"{name:5s} search: median {med:.3f} s wall (min {min(xs):.3f}, max {max(xs):.3f}), "
              f"{statistics.median(cpu):.3f} s CPU = {med / GOAL_S:.2f} x the {GOAL_S:.0f} s goal")
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores while measuring)")
    best = result.best
    print(f"best: dp{best['dp']} tp{best['tp']} pp{best['pp']} {best['schedule']} {best['step_time_s']:.2f} s/step")


if __name__ == "__main__":
    main()
