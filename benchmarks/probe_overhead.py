"""Probe overhead: what dtprobe's collectors and its runtime cost per training step, measured side by side.

    python benchmarks/probe_overhead.py [--nproc 2] [--steps 100] [--pairs 3]
                                        [--cases record_cost,ddp,runtime,small,small_async]
                                        [--flush-baseline 1.0] [--concurrent | --pinned]
                                        [--record-cost-rounds 40] [--record-cost-block 200]

Ratios of median step time, each from runs alternated in one invocation (A B A B ...) so that drift of the
shared machine hits both sides alike; with `--concurrent` the sides of each pair run at the same time instead
(they share the cores, so a burst of outside load hits every side at once, but so does each side's own extra work:
the ratio understates it). With `--pinned` the sides also run at the same time, each confined with `taskset` to
its own block of the cores (the blocks rotate between the sides every pair), so drift of the machine hits both
sides while each side's threads stay on its own cores: on a host whose speed drifts between runs it is the
precise one; `--pinned --nproc 1` runs one rank per side on a 2-core machine. Each case below is one entry of
`CASES` (its sides and its report function); `--cases` picks some, and the sides of all picked cases are
alternated together:

1. collectors on / off (`ddp`): `dtprobe run` with its default telemetry (every collective recorded by the wrapping
   ProcessGroup, host/NVML sampler, steps, and the loss bound: rows flushed every `collect.flush_interval_s`
   and in-flight collectives spilled to `pending` by background threads, SIGTERM handler) against
   `dtprobe run --no-collectives --no-devices` (only the steps table, which both sides need to time the step).
   Goal <= 1.01. Also, in CPU time rather than wall time: the share of a core that each worker's Python threads
   besides its main one took over the timed steps, on minus off (read from /proc's schedstat of every thread while
   the sides run, `TreeThreadCpu`): what the collector threads cost a rank, which the machine's drift between runs
   does not move as it moves step times.
2. runtime / plain (`runtime`): `dtprobe run --no-collectives --no-devices` against benchmarks/plain_ddp.py, a 30-line
   torchrun DDP script of the same model, batch and optimizer, timed the same way (data, forward, backward,
   clip, optimizer, loss.item()). Goal <= 1.02.
3. with `--flush-baseline S` (`flush`): the default telemetry against the same with `collect.flush_interval_s = S`
   (e.g. 1.0, flushing ten times less often): what the loss bound costs. Goal <= 1.01.

Printed first, in this process and in a few seconds: the thread CPU time of the recorder's drain thread (which
also flushes the writer; its own flusher stops meanwhile) while rows arrive at a fixed rate (500 collectives/s, 1
in 50 left in flight for 0.3 s so it is spilled to `pending`, 10 steps rows/s), at the default interval and at
1 s. Per-thread CPU clocks do not count time spent waiting for a core, so this figure holds on a loaded machine
too.

4. many small collectives, on / off (`small`): a torchrun worker of this file (`--small-worker`) attached with the
   default telemetry against the same with `collectives=False, devices=False`, each step a small matmul and
   `--small-collectives` (200) blocking all_reduce of 1 KiB, the pattern of tensor-parallel and FSDP steps.
5. the same with each all_reduce issued with `async_op=True` and waited at once (`small_async`): how DTensor and
   FSDP use their works, recorded through the group's Python Work wrapper instead of the blocking-call path.
6. launch / torchrun (`launch`, not in the default cases): examples/launch/train_ddp.py, an unmodified DDP script
   (it calls init_process_group itself), under `dtprobe launch` against the same script under plain torchrun; each
   side's step is its training loop's wall time (the script's `--report`, rank 0) over its optimizer steps, so
   start-up, compaction and the findings printed after the run are left out. Goal <= 1.01. The model is the
   script's MLP sized by `--launch-model HIDDEN,LAYERS` (default 2048,2: a hidden x hidden layer, so a step does
   real work and DDP all-reduces 16 MB of gradients); `--launch-model 64,1` is the script's tiny default, the
   worst case for a fixed cost per step. The difference per step is printed too.

7. recording cost, precise (`record_cost`, first in the default cases, a few seconds): one process, a 1-rank gloo
   group attached with the default telemetry (devices off), small all_reduce (1 KiB) issued in blocks of
   `--record-cost-block` (200) through the recording group and through the plain gloo group it wraps, the blocks
   interleaved (`--record-cost-rounds` of each), in four ways: `blocking` (`dist.all_reduce`), `async`
   (`async_op=True`, waited at once: DTensor, FSDP), `future` (the work's future waited at once from Python:
   `get_future().wait()`) and `wait_all` (the work's future waited through `torch.futures.wait_all`, never by a
   Python `wait()` on it, as DDP's reducer waits in C++). `gloo` is the group as attached (collectives recorded
   by the native recorder, collectors/native_recorder.cpp, when it is built; the first line says which),
   `gloo-python` the same gloo group recorded on the Python path (`RecordingProcessGroup(..., native=False)`: the
   fallback without a build), `stub` the Python path around a stub backend (every call returns one completed gloo
   Work), which leaves the Python recording path alone. Per recorded collective, each round's difference
   recorded - plain of the caller thread's CPU time (`time.thread_time`: waiting for a core is not counted), of
   the process CPU time (all threads, once the recorder has encoded the block's rows: the drain thread's share,
   and gloo's thread running a done-callback) and of wall time; median and 10th-90th percentile over the
   rounds. Without a peer, gloo's cost is a thread hand-off, so the difference is the recording cost itself
   rather than the noise of a 2-rank collective.

Per recorded collective, for the DDP case and the many-small cases: (median step on - median step off) divided by
the collectives rank 0 recorded per step in the "on" run; for the many-small cases also the same from each rank's
process CPU time per step (all its threads): waiting for a core is not counted, though a loaded machine still
inflates it (contended caches, gloo's polling while it waits). Both figures need a quiet machine, and neither
judges the goal of at most 10 us per collective on gloo: the precise case (7) does, on its caller-thread CPU of the
group as attached, in its last line (`record_cost_verdict`). Every figure made from pairs of runs is printed with
the standard error of its median over the pairs (`median_error`): where that error is larger than the figure's
distance to its goal, pairs of identical runs scatter more than the effect measured.

The first `--skip` steps of every run are left out (DDP rebuilds its buckets after step 0). On a CPU machine the
figures are CPU/gloo ones, not GPU ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
SMALL_SIDES = ("small_on", "small_off", "small_async_on", "small_async_off")
"""Sides run by this file's many-small-collectives worker (they write process CPU per step)."""
LAUNCH_SIDES = ("launch_on", "launch_plain")
"""Sides running examples/launch/train_ddp.py under `dtprobe launch` and under plain torchrun."""
LAUNCH_BATCH = 16
"""Per-rank batch of the launch sides (the script's default)."""
RECORDING_SIDES = ("on", "small_on", "small_async_on")
"""Sides that record collectives (their collectives per step divide the cost)."""
THREAD_SIDES = ("on", "off")
"""`dtprobe run` sides whose workers' threads are clocked while they run (``TreeThreadCpu``)."""


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def side_command(name: str, out: Path, *, nproc: int, steps: int, flush_baseline: float | None,
                 num_small: int, launch_model: tuple[int, int] = (2048, 2)) -> list[str]:
    """The command of one side: "on", "off", "slowflush" (`dtprobe run`), "plain" (benchmarks/plain_ddp.py),
    "small_on", "small_off", "small_async_on" or "small_async_off" (this file's many-small-collectives worker
    under torchrun)."""
    if name in LAUNCH_SIDES:
        script = [str(ROOT / "examples" / "launch" / "train_ddp.py"), "--samples", str(steps * LAUNCH_BATCH * nproc),
                  "--batch-size", str(LAUNCH_BATCH), "--hidden", str(launch_model[0]), "--layers",
                  str(launch_model[1]), "--report", str(out / "report.json")]
        if name == "launch_plain":
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    *script]
        return [sys.executable, "-m", "dtprobe.cli", "launch", "--nproc", str(nproc), "--run-dir", str(out / "run"),
                *script]
    if name == "plain":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                str(ROOT / "benchmarks" / "plain_ddp.py"), "--steps", str(steps), "--out", str(out)]
    if name in SMALL_SIDES:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                str(Path(__file__).resolve()), "--small-worker", str(out), "--steps", str(steps),
                "--small-collectives", str(num_small)] + (["--small-off"] if name.endswith("_off") else []) + (
                ["--small-async"] if name.startswith("small_async") else [])
    cmd = [sys.executable, "-m", "dtprobe.cli", "run", "--nproc", str(nproc), "--steps", str(steps),
           "--run-dir", str(out), "--warmup", "0"]
    if name == "off":
        cmd += ["--no-collectives", "--no-devices"]
    if name == "slowflush":
        cmd += ["--set", f"collect.flush_interval_s={flush_baseline}"]
    return cmd


def _leader_steps(out: Path):
    """Rank 0's ``steps`` rows of a finished `dtprobe run` side, in step order."""
    from dtprobe.store import RunStore

    steps_df = RunStore.open(out).table("steps")
    return steps_df[steps_df["rank"] == 0].sort_values("step")


def side_step_times(name: str, out: Path) -> list[float]:
    """Rank 0's step times (s) of a finished side."""
    if name == "plain":
        return json.loads(out.read_text())["step_s"]
    leader = _leader_steps(out)
    return ((leader["end_ns"] - leader["start_ns"]).astype("float64") / 1e9).tolist()


def steps_window_ns(out: Path, skip: int) -> tuple[int, int]:
    """When rank 0's timed steps (after ``skip``) of a finished `dtprobe run` side began and ended (wall ns)."""
    leader = _leader_steps(out)
    timed = leader[leader["step"] >= skip]
    return int(timed["start_ns"].min()), int(timed["end_ns"].max())


class TreeThreadCpu:
    """While a side runs: every ``interval_s``, the CPU time of every Python thread of every process under ``root``
    (the side's command), from ``/proc/PID/task/TID/schedstat`` (ns on the CPU; waiting for a core is not
    counted), stamped with the wall clock. ``samples``: (time_ns, {pid: {tid: cpu_ns}}) in time order. A Python
    thread keeps its process's name (``/proc/PID/task/TID/comm``); the threads that gloo and torch start name
    themselves (``gloo_tcp_loop``, ``pt_gloo_runloop``, ...) and are left out: their CPU follows how long the
    collectives wait, which differs from run to run on both sides."""

    def __init__(self, root: int, interval_s: float = 0.25) -> None:
        import threading

        self.root, self.interval_s = root, interval_s
        self.samples: list[tuple[int, dict[int, dict[int, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-thread-cpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import time

        while not self._stop.wait(self.interval_s):
            tree: dict[int, dict[int, int]] = {}
            todo = [self.root]
            while todo:
                pid = todo.pop()
                try:
                    with open(f"/proc/{pid}/task/{pid}/children") as f:
                        todo += [int(x) for x in f.read().split()]
                    name = _thread_name(pid, str(pid))
                    tree[pid] = {int(tid): _schedstat_ns(pid, tid) for tid in os.listdir(f"/proc/{pid}/task")
                                 if _thread_name(pid, tid) == name}
                except (OSError, ValueError):       # the process or a thread ended meanwhile
                    continue
            self.samples.append((time.time_ns(), tree))

    def stop(self) -> list[tuple[int, dict[int, dict[int, int]]]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def _thread_name(pid: int, tid: str) -> str:
    with open(f"/proc/{pid}/task/{tid}/comm") as f:
        return f.read().strip()


def _schedstat_ns(pid: int, tid: str) -> int:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


def helper_thread_share(samples: list[tuple[int, dict[int, dict[int, int]]]], first_ns: int, last_ns: int,
                        nproc: int) -> float | None:
    """The CPU share of one core that each worker's Python threads other than its main one took between the first
    and the last sample inside ``first_ns``..``last_ns`` (the steps timed), mean over the ``nproc`` workers (the
    processes that used the most CPU then); None with fewer than two samples inside. These are dtprobe's threads
    (recorder drain, which flushes the writer, and device sampler; with collectives off the writer's own flusher,
    of the steps rows) and any the training's Python code starts."""
    inside = [(t, tree) for t, tree in samples if first_ns <= t <= last_ns]
    if len(inside) < 2:
        return None
    (t0, a), (t1, b) = inside[0], inside[-1]
    used = {pid: sum(b[pid].values()) - sum(a[pid].values()) for pid in b if pid in a}
    workers = sorted(used, key=used.get, reverse=True)[:nproc]
    shares = [sum(ns - a[pid].get(tid, 0) for tid, ns in b[pid].items() if tid != pid) / (t1 - t0)
              for pid in workers]
    return statistics.mean(shares) if shares else None


def run_sides(commands: dict[str, list[str]], logs: Path, *, concurrent: bool,
              cores: dict[str, list[int]] | None = None,
              clocked: tuple[str, ...] = ()) -> dict[str, list[tuple[int, dict[int, dict[int, int]]]]]:
    """Run the commands one after another, or all at once (also with ``cores``: each command confined to its
    cores with ``taskset``); a failing side raises with its log's tail. The sides named in ``clocked`` have their
    threads' CPU sampled while they run (``TreeThreadCpu``): returned by side."""
    logs.mkdir(parents=True, exist_ok=True)
    names = list(commands)
    batches = [names] if concurrent or cores else [[n] for n in names]
    clocks: dict[str, TreeThreadCpu] = {}
    samples = {}
    for batch in batches:
        procs = {}
        for name in batch:
            pin = ["taskset", "-c", ",".join(map(str, cores[name]))] if cores else []
            with open(logs / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(pin + commands[name], env=_env(), stdout=log,
                                               stderr=subprocess.STDOUT)
            if name in clocked:
                clocks[name] = TreeThreadCpu(procs[name].pid)
        for name, proc in procs.items():
            try:
                code = proc.wait(timeout=900)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = "timeout"
            if name in clocks:
                samples[name] = clocks.pop(name).stop()
            if code != 0:
                tail = (logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"side {name!r} failed ({code}): {' '.join(commands[name])}\n{tail}")
    return samples


def bound_thread_cpu(run_dir: Path, *, interval_s: float, seconds: float = 3.0, rate_per_s: int = 500) -> float:
    """Thread CPU seconds per wall second of dtprobe's threads that flush rows (see the module docstring)."""
    import threading
    import time

    from dtprobe.collectors.collective_recorder import CollectiveRecorder
    from dtprobe.store.writer import RankWriter

    writer = RankWriter(run_dir, 0, flush_interval_s=interval_s, autoflush=True)
    recorder = CollectiveRecorder()
    recorder.start(writer, flush_interval_s=interval_s)
    # noqa below: measuring our own threads; the writer has none while the drain thread flushes it
    threads = [writer._flusher, recorder._drainer]  # noqa: SLF001
    clocks = [time.pthread_getcpuclockid(t.ident) for t in threads if isinstance(t, threading.Thread)]
    cpu0 = [time.clock_gettime(c) for c in clocks]
    t0 = time.monotonic()
    held: list[tuple[float, int, tuple]] = []
    group = recorder.group_key("world", "0,1", 2)
    n = 0
    while (now := time.monotonic()) - t0 < seconds:
        n += 1
        # A gloo collective's row as the recording group makes it: a tuple of ROW_COLUMNS, end_ns appended.
        row = (group, n, "allreduce", 4096, "float32", n // 50, "host", time.time_ns(), 0)
        key = recorder.track(row)
        if n % 50 == 0:
            held.append((now + 0.3, key, row))
        elif recorder.untrack(key):
            recorder.emit(row + (time.time_ns(),))
        while held and held[0][0] <= now:
            _, key, row = held.pop(0)
            if recorder.untrack(key):
                recorder.emit(row + (time.time_ns(),))
        if n % (rate_per_s // 10) == 0:
            writer.write("steps", {"step": n, "start_ns": time.time_ns(), "end_ns": time.time_ns()})
        time.sleep(max(0.0, t0 + n / rate_per_s - time.monotonic()))
    cpu = sum(time.clock_gettime(c) - c0 for c, c0 in zip(clocks, cpu0))
    wall = time.monotonic() - t0
    recorder.stop()
    writer.close()
    return cpu / wall


def median_after(times: list[float], skip: int) -> float:
    return statistics.median(times[skip:])


def collectives_per_step(run_dir: Path, skip: int) -> float:
    """Median number of collectives rank 0 recorded per step (steps after ``skip``) in a finished "on" side."""
    from dtprobe.store import RunStore

    coll = RunStore.open(run_dir).table("collectives")
    counts = coll[(coll["rank"] == 0) & (coll["step"] >= skip)].groupby("step").size()
    return float(counts.median()) if len(counts) else 0.0


def cpu_per_step(run_dir: Path) -> float:
    """Mean over ranks of the process CPU seconds per step written by ``small_worker``."""
    values = [json.loads(f.read_text())["cpu_s_per_step"] for f in sorted(run_dir.glob("cpu_rank*.json"))]
    return statistics.mean(values)


def small_worker(run_dir: str, *, steps: int, num_collectives: int, off: bool, async_op: bool = False) -> None:
    """One rank of the many-small-collectives cases (launched by torchrun): each step a small matmul and
    ``num_collectives`` all_reduce of 256 float32 on the default group, timed by ``probe.step``; blocking calls,
    or with ``async_op`` issued with ``async_op=True`` and waited at once (how DTensor and FSDP use their works)."""
    import time

    import torch
    import torch.distributed as dist

    import dtprobe

    torch.set_num_threads(1)
    options = {"collectives": False, "devices": False} if off else {}
    probe = dtprobe.attach(run_dir, **options)
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    grad = torch.ones(256)
    cpu_ns = 0
    for step in range(steps):
        cpu0 = time.process_time_ns()
        with probe.step(step):
            x = weight
            for _ in range(4):
                x = torch.tanh(x @ weight)
            if async_op:
                for _ in range(num_collectives):
                    dist.all_reduce(grad, async_op=True).wait()
            else:
                for _ in range(num_collectives):
                    dist.all_reduce(grad)
        cpu_ns += time.process_time_ns() - cpu0
    # This process's CPU time (every thread: gloo's, the probe's) per step: waiting for a core is not counted.
    (Path(run_dir) / f"cpu_rank{dist.get_rank()}.json").write_text(json.dumps({"cpu_s_per_step": cpu_ns / steps / 1e9}))
    probe.close()
    dist.destroy_process_group()      # gloo's threads stopped before the interpreter exits, not torn down by it


RECORD_COST_MODES = ("blocking", "async", "future", "wait_all")
"""How the ``record_cost`` case issues and waits its collectives (module docstring, item 7)."""
RECORD_COST_BACKENDS = ("gloo", "gloo-python", "stub")
"""The ``record_cost`` case's (plain, recorded) pairs (module docstring, item 7)."""


def _record_cost_pairs(plain: Any, recorded: Any, python_recorded: Any, stub: Any,
                      stub_recorded: Any) -> list[tuple[str, tuple[Any, Any]]]:
    """``RECORD_COST_BACKENDS`` with their (plain, recorded) groups."""
    return list(zip(RECORD_COST_BACKENDS, ((plain, recorded), (plain, python_recorded), (stub, stub_recorded))))


def _issue_block(group: Any, tensor: Any, count: int, mode: str) -> None:
    """``count`` all_reduce of ``tensor`` on ``group``, each issued and waited as ``mode`` says."""
    import torch
    import torch.distributed as dist

    if mode == "blocking":
        for _ in range(count):
            dist.all_reduce(tensor, group=group)
    elif mode == "async":
        for _ in range(count):
            dist.all_reduce(tensor, group=group, async_op=True).wait()
    elif mode == "future":
        for _ in range(count):
            dist.all_reduce(tensor, group=group, async_op=True).get_future().wait()
    else:
        for _ in range(count):
            torch.futures.wait_all([dist.all_reduce(tensor, group=group, async_op=True).get_future()])


class _StubBackend:
    """A backend whose every all_reduce returns the same completed gloo Work: no communication at all, so a
    recording group around it costs only the Python recording path."""

    def __init__(self, done: Any) -> None:
        self.done = done

    def allreduce(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        return self.done

    def _set_group_name(self, name: str) -> None:
        pass


def _interleaved_costs(plain: Any, recorded: Any, *, mode: str, rounds: int,
                       block: int) -> dict[str, list[list[float]]]:
    """Per round and side ("plain", "recorded"): [caller-thread CPU, process CPU, wall] per collective (us)."""
    import time

    import torch

    from dtprobe.collectors.collective_recorder import RECORDER

    tensor = torch.ones(256)
    for group in (plain, recorded):       # warm-up: the recording group's first works learn how they are waited
        _issue_block(group, tensor, block, mode)
    RECORDER.drain()
    sides = (("plain", plain), ("recorded", recorded))
    took: dict[str, list[list[float]]] = {"plain": [], "recorded": []}
    for i in range(rounds):
        for name, group in sides if i % 2 == 0 else sides[::-1]:
            thread0, process0, wall0 = time.thread_time_ns(), time.process_time_ns(), time.perf_counter_ns()
            _issue_block(group, tensor, block, mode)
            thread1, wall1 = time.thread_time_ns(), time.perf_counter_ns()
            RECORDER.drain()              # the block's rows encoded, here or by the drain thread
            took[name].append([(thread1 - thread0) / block / 1e3, (time.process_time_ns() - process0) / block / 1e3,
                               (wall1 - wall0) / block / 1e3])
    return took


def record_cost_worker(out: Path, *, rounds: int, block: int) -> None:
    """The ``record_cost`` case in this process (module docstring, item 7): writes its per-collective costs as
    JSON to ``out``."""
    import tempfile

    import torch
    import torch.distributed as dist

    import dtprobe
    from dtprobe.collectors.collective_recorder import RECORDER
    from dtprobe.collectors.pg_wrapper import GLOO_BACKEND, RecordingProcessGroup

    torch.set_num_threads(1)
    results: dict[str, Any] = {"rounds": rounds, "block": block}
    with tempfile.TemporaryDirectory(prefix="dtprobe-record-cost-") as tmp:
        probe = dtprobe.attach(tmp, devices=False)          # a 1-rank gloo group, its default group recorded
        recorded = dist.distributed_c10d._get_default_group()
        plain = recorded.inner
        done = plain.allreduce([torch.ones(256)])
        done.wait()
        stub = _StubBackend(done)
        stub_recorded = RecordingProcessGroup(stub, 0, 1, backend_name=GLOO_BACKEND)
        stub_recorded.dtprobe_name = "stub"
        stub_recorded._ranks_str = "0"     # noqa: SLF001 - members of a group torch does not know
        python_recorded = RecordingProcessGroup(plain, 0, 1, backend_name=GLOO_BACKEND, native=False)
        python_recorded.dtprobe_name = "python"
        python_recorded._ranks_str = "0"   # noqa: SLF001
        results["recorder"] = "native" if hasattr(recorded, "_native_backends") else "Python (native not built)"
        with probe.step(0):
            for backend, pair in _record_cost_pairs(plain, recorded, python_recorded, stub, stub_recorded):
                for mode in RECORD_COST_MODES:
                    results[f"{backend}/{mode}"] = _interleaved_costs(*pair, mode=mode, rounds=rounds, block=block)
        issued = sum(p["last_issued_seq"] for p in RECORDER.progress().values())
        completed = sum(p["last_completed_seq"] for p in RECORDER.progress().values())
        expected = 3 * len(RECORD_COST_MODES) * (rounds + 1) * block
        if not issued == completed == expected:
            raise SystemExit(f"record_cost: {issued} collectives issued and {completed} completed were recorded, "
                             f"not the {expected} run through the recording groups")
        probe.close()
    out.write_text(json.dumps(results))


def _round_costs(took: dict[str, list[list[float]]], clock: int) -> list[float]:
    """Per round, recorded - plain on clock ``clock`` (0 caller thread CPU, 1 process CPU, 2 wall), us."""
    return [r[clock] - p[clock] for r, p in zip(took["recorded"], took["plain"])]


def _cost_line(key: str, took: dict[str, list[list[float]]]) -> str:
    """One way's costs: per clock, the median (10th .. 90th percentile) over rounds of recorded - plain, and the
    difference of each side's best round (load only adds time, so the best rounds are the least disturbed)."""
    parts = []
    for k, clock in enumerate(("caller thread CPU", "process CPU", "wall")):
        diffs = _round_costs(took, k)
        deciles = statistics.quantiles(diffs, n=10) if len(diffs) > 1 else diffs * 9
        best = min(r[k] for r in took["recorded"]) - min(p[k] for p in took["plain"])
        parts.append(f"{clock} {statistics.median(diffs):5.1f} ({deciles[0]:.1f} .. {deciles[-1]:.1f}; best "
                     f"{best:.1f})")
    plain = statistics.median(p[0] for p in took["plain"])
    return f"  {key:<20} " + ", ".join(parts) + f" [plain: {plain:.1f} thread CPU]"


def report_record_cost(results: "Results", args: argparse.Namespace) -> list[str]:
    """Case 7: runs ``record_cost_worker`` in a child process and prints its per-collective costs."""
    with tempfile.TemporaryDirectory(prefix="dtprobe-bench-") as tmp:
        out = Path(tmp) / "record_cost.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--record-cost-worker", str(out),
               "--record-cost-rounds", str(args.record_cost_rounds), "--record-cost-block", str(args.record_cost_block)]
        run_sides({"record_cost": cmd}, Path(tmp) / "logs", concurrent=False)
        costs = json.loads(out.read_text())
    lines = [f"per recorded collective, precise (us; 1 process, recorded - plain over {costs['rounds']} interleaved "
             f"blocks of {costs['block']} all_reduce of 1 KiB; CPU + gloo, not GPU; gloo recorded by the "
             f"{costs['recorder']} recorder):"]
    lines += [_cost_line(key, costs[key])
              for key in (f"{b}/{m}" for b in RECORD_COST_BACKENDS for m in RECORD_COST_MODES)]
    lines.append("  (gloo: a 1-rank gloo group as attached; gloo-python: the same on the Python path; stub: the Python "
                 "recording path alone)")
    lines.append(record_cost_verdict(costs))
    return lines


RECORD_COST_GOAL_US = 10.0
"""Issue 15's goal per recorded collective on gloo, judged on the caller thread's CPU of the group as attached."""


def record_cost_verdict(costs: dict[str, Any]) -> str:
    """The per-collective goal judged on the precise case: the median caller-thread CPU (recorded - plain) of the
    group as attached (``gloo``), in every way of issuing and waiting; the largest of them decides."""
    medians = {mode: statistics.median(_round_costs(costs[f"gloo/{mode}"], 0)) for mode in RECORD_COST_MODES}
    worst = max(medians, key=medians.get)
    met = "met" if medians[worst] <= RECORD_COST_GOAL_US else "NOT met"
    return (f"per recorded collective, goal <= {RECORD_COST_GOAL_US:g} us (caller thread CPU, gloo as attached, "
            f"{costs['recorder']} recorder): {met}; largest {medians[worst]:.1f} us ({worst})")


@dataclass(frozen=True)
class Results:
    """What the alternated runs gave, per side: rank 0's median step (s) of each pair, and for the sides that
    record collectives, the collectives rank 0 recorded per step; for the many-small sides, process CPU per step."""

    medians: dict[str, list[float]]
    per_step: dict[str, list[float]]
    cpu: dict[str, list[float]]
    threads: dict[str, list[float | None]] = field(default_factory=dict)
    """For ``THREAD_SIDES``: each pair's ``helper_thread_share`` over the timed steps."""


def median_error(values: list[float]) -> float | None:
    """The standard error of the median of ``values`` (sqrt(pi / 2) x their standard deviation / sqrt(n), the
    normal approximation); None for fewer than 2. A figure whose error exceeds its distance to a goal does not
    decide it: pairs of identical runs scatter that much on the machine."""
    if len(values) < 2:
        return None
    return 1.2533 * statistics.stdev(values) / len(values) ** 0.5


def _error_text(values: list[float], spec: str, unit: str = "") -> str:
    error = median_error(values)
    return "" if error is None else f"; standard error +-{error:{spec}}{unit}"


def _ratio_line(label: str, results: Results, on: str, off: str, goal: str) -> str:
    ratios = [a / b for a, b in zip(results.medians[on], results.medians[off])]
    return (f"{label} {statistics.median(ratios):.3f}  (per pair: {', '.join(f'{r:.3f}' for r in ratios)}"
            f"{_error_text(ratios, '.3f')}{'; goal ' + goal if goal else ''})")


def _per_collective_lines(label: str, results: Results, on: str, off: str) -> list[str]:
    """Per recorded collective: the step-time difference over the collectives per step; from process CPU too when
    the sides wrote it."""
    counts = results.per_step[on]
    costs = [(a - b) / n * 1e6 for a, b, n in zip(results.medians[on], results.medians[off], counts) if n]
    if not costs:
        return [f"per recorded collective, {label}: no collectives"]
    lines = [f"per recorded collective, {label}: {statistics.median(costs):.1f} us  (per pair: "
             f"{', '.join(f'{c:.1f}' for c in costs)}{_error_text(costs, '.1f', ' us')}; "
             f"{statistics.median(counts):.0f} collectives per step; {PAIR_FIGURE_NOTE})"]
    if on in results.cpu:
        cpu_costs = [(a - b) / n * 1e6 for a, b, n in zip(results.cpu[on], results.cpu[off], counts) if n]
        lines.append(f"per recorded collective, {label}, process CPU: {statistics.median(cpu_costs):.1f} us  "
                     f"(per pair: {', '.join(f'{c:.1f}' for c in cpu_costs)}{_error_text(cpu_costs, '.1f', ' us')}; "
                     f"{PAIR_FIGURE_NOTE})")
    return lines


PAIR_FIGURE_NOTE = "a step-time difference: the precise case judges the 10 us goal"


def report_ddp(results: Results, args: argparse.Namespace) -> list[str]:
    """Case 1: `dtprobe run` with default telemetry against collectives and devices off."""
    return [_ratio_line("collectors on/off ratio:  ", results, "on", "off", "<= 1.01"),
            *_per_collective_lines("DDP", results, "on", "off"), _thread_line(results, "on", "off")]


def _thread_line(results: Results, on: str, off: str) -> str:
    """The CPU share of a core that the on side's workers' Python threads besides the main one took over the off
    side's (``helper_thread_share``: the collector threads, measured in CPU time, so the machine's drift between
    runs does not enter)."""
    pairs = [(a, b) for a, b in zip(results.threads.get(on, []), results.threads.get(off, []))
             if a is not None and b is not None]
    if not pairs:
        return "collector threads' CPU per rank: not measured (no schedstat, or too few samples in the steps)"
    diffs = [100 * (a - b) for a, b in pairs]
    on_pct, off_pct = (100 * statistics.median(side) for side in zip(*pairs))
    return (f"collector threads' CPU per rank, on - off: {statistics.median(diffs):.2f}% of a core  (worker Python "
            f"threads besides the main one over the timed steps, from schedstat; on {on_pct:.2f}%, off {off_pct:.2f}%; "
            f"per pair: {', '.join(f'{d:.2f}' for d in diffs)}{_error_text(diffs, '.2f', '%')})")


def report_runtime(results: Results, args: argparse.Namespace) -> list[str]:
    """Case 2: `dtprobe run` without collectors against the plain DDP script."""
    return [_ratio_line("runtime/plain ratio:      ", results, "off", "plain", "<= 1.02")]


def report_flush(results: Results, args: argparse.Namespace) -> list[str]:
    """Case 3: the default flush interval against ``--flush-baseline``."""
    from dtprobe.collectors.config import CollectConfig

    defaults = CollectConfig()
    return [_ratio_line(f"flush {defaults.flush_interval_s} s / {args.flush_baseline} s ratio:", results, "on",
                        "slowflush", "<= 1.01")]


def report_small(results: Results, args: argparse.Namespace) -> list[str]:
    """Case 4: many small blocking all_reduce per step."""
    return [_ratio_line("many small collectives on/off ratio:", results, "small_on", "small_off", ""),
            *_per_collective_lines("many small", results, "small_on", "small_off")]


def report_small_async(results: Results, args: argparse.Namespace) -> list[str]:
    """Case 5: many small all_reduce per step issued with ``async_op=True`` and waited at once."""
    return [_ratio_line("many small async collectives on/off ratio:", results, "small_async_on", "small_async_off",
                        ""),
            *_per_collective_lines("many small async", results, "small_async_on", "small_async_off")]


def report_launch(results: Results, args: argparse.Namespace) -> list[str]:
    """Case 6: an unmodified DDP script under `dtprobe launch` against plain torchrun."""
    diffs = [(a - b) * 1e6 for a, b in zip(results.medians["launch_on"], results.medians["launch_plain"])]
    plain_ms = statistics.median(results.medians["launch_plain"]) * 1e3
    return [_ratio_line("launch/torchrun ratio:    ", results, "launch_on", "launch_plain", "<= 1.01"),
            f"launch cost per step: {statistics.median(diffs):.0f} us  (per pair: "
            f"{', '.join(f'{d:.0f}' for d in diffs)}; plain torchrun step {plain_ms:.2f} ms, MLP hidden "
            f"{args.launch_model[0]} x {args.launch_model[1]} layers)"]


CASES: dict[str, tuple[tuple[str, ...], Callable[[Results, argparse.Namespace], list[str]]]] = {
    "ddp": (("on", "off"), report_ddp),
    "runtime": (("off", "plain"), report_runtime),
    "flush": (("on", "slowflush"), report_flush),
    "small": (("small_on", "small_off"), report_small),
    "small_async": (("small_async_on", "small_async_off"), report_small_async),
    "launch": (("launch_on", "launch_plain"), report_launch),
    "record_cost": ((), report_record_cost),
}
"""Each case: the sides it compares (run alternated with every other selected case's sides) and its report."""
DEFAULT_CASES = ("record_cost", "ddp", "runtime", "small", "small_async")
"""Cases run without ``--cases``; ``flush`` is added by ``--flush-baseline``."""


def run_cases(cases: list[str], args: argparse.Namespace) -> Results:
    """Run every side of ``cases`` ``args.pairs`` times, alternated (rotating who starts first), and collect
    step medians, collectives per step and CPU per step."""
    names = tuple(dict.fromkeys(side for case in cases for side in CASES[case][0]))
    results = Results(medians={name: [] for name in names},
                      per_step={name: [] for name in names if name in RECORDING_SIDES},
                      cpu={name: [] for name in names if name in SMALL_SIDES})
    with tempfile.TemporaryDirectory(prefix="dtprobe-bench-") as tmp:
        tmp_path = Path(tmp)
        for i in range(args.pairs if names else 0):
            order = names[i % len(names):] + names[:i % len(names)]       # rotate who starts first
            outs = {name: tmp_path / (f"{name}{i}.json" if name == "plain" else f"{name}{i}") for name in order}
            for name in order:
                if name in LAUNCH_SIDES:
                    outs[name].mkdir()
            commands = {name: side_command(name, outs[name], nproc=args.nproc, steps=args.steps,
                                           flush_baseline=args.flush_baseline, num_small=args.small_collectives,
                                           launch_model=args.launch_model)
                        for name in order}
            clocked = run_sides(commands, tmp_path / f"logs{i}", concurrent=args.concurrent,
                                cores=pinned_cores(order) if args.pinned else None,
                                clocked=tuple(n for n in order if n in THREAD_SIDES))
            for name, samples in clocked.items():
                results.threads.setdefault(name, []).append(
                    helper_thread_share(samples, *steps_window_ns(outs[name], args.skip), args.nproc))
            for name in names:
                if name in LAUNCH_SIDES:      # the loop's mean step: the script times its loop, not each step
                    report = json.loads((outs[name] / "report.json").read_text())
                    results.medians[name].append(report["loop_s"] / report["optimizer_steps"])
                else:
                    results.medians[name].append(median_after(side_step_times(name, outs[name]), args.skip))
                print(f"pair {i + 1}/{args.pairs} {name:>15}: median step {results.medians[name][-1] * 1e3:7.2f} ms",
                      flush=True)
            for name in results.per_step:
                results.per_step[name].append(collectives_per_step(outs[name], args.skip))
            for name in results.cpu:
                results.cpu[name].append(cpu_per_step(outs[name]))
    return results


def pinned_cores(order: tuple[str, ...]) -> dict[str, list[int]]:
    """``--pinned``: the usable cores cut into one block per side, the first block to ``order``'s first side (the
    caller rotates ``order`` every pair, so every side runs on every block alike)."""
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // len(order)
    return {name: cores[j * per:(j + 1) * per] for j, name in enumerate(order)}


def _launch_model(text: str) -> tuple[int, int]:
    try:
        hidden, layers = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--launch-model takes HIDDEN,LAYERS (e.g. 2048,2), not {text!r}") from None
    if hidden < 1 or layers < 1:
        raise argparse.ArgumentTypeError(f"--launch-model {text}: both numbers must be at least 1")
    return hidden, layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run (default 2: one per core)")
    parser.add_argument("--steps", type=int, default=100, help="steps per run (default 100)")
    parser.add_argument("--pairs", type=int, default=3, help="alternated pairs per comparison (default 3)")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of each run (default 5)")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated cases to run, of {', '.join(CASES)} (default: "
                             f"{','.join(DEFAULT_CASES)}, plus flush with --flush-baseline)")
    parser.add_argument("--flush-baseline", type=float, default=None, metavar="S",
                        help="also run the default telemetry with collect.flush_interval_s=S and print the ratio "
                             "default / S (what the loss bound costs); default: not run")
    sides_at_once = parser.add_mutually_exclusive_group()
    sides_at_once.add_argument("--concurrent", action="store_true",
                               help="run the sides of each pair at the same time (fairer on a busy machine; every "
                                    "side is slower, and each side's extra work slows the others too)")
    sides_at_once.add_argument("--pinned", action="store_true",
                               help="run the sides of each pair at the same time, each on its own block of the "
                                    "cores (taskset; blocks rotate every pair): for a host whose speed drifts "
                                    "between runs; needs a core per side (with 2 cores: --nproc 1, one case)")
    parser.add_argument("--small-collectives", type=int, default=200,
                        help="all_reduce per step in the many-small-collectives cases (default 200)")
    parser.add_argument("--launch-model", type=_launch_model, default=(2048, 2), metavar="HIDDEN,LAYERS",
                        help="the launch case's MLP: hidden width and hidden layers (default 2048,2; 64,1 is the "
                             "script's tiny default)")
    parser.add_argument("--record-cost-rounds", type=int, default=40,
                        help="record_cost case: interleaved blocks per side and way of waiting (default 40)")
    parser.add_argument("--record-cost-block", type=int, default=200,
                        help="record_cost case: all_reduce per block (default 200)")
    parser.add_argument("--record-cost-worker", metavar="OUT_JSON", help=argparse.SUPPRESS)
    parser.add_argument("--small-worker", metavar="RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--small-off", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--small-async", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record_cost_worker:
        record_cost_worker(Path(args.record_cost_worker), rounds=args.record_cost_rounds, block=args.record_cost_block)
        return 0
    if args.small_worker:
        small_worker(args.small_worker, steps=args.steps, num_collectives=args.small_collectives, off=args.small_off,
                     async_op=args.small_async)
        return 0
    cases = list(DEFAULT_CASES) + (["flush"] if args.flush_baseline is not None else [])
    if args.cases is not None:
        cases = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = sorted(set(cases) - set(CASES))
        if unknown or not cases:
            parser.error(f"--cases {args.cases!r}: unknown {unknown or 'none given'}; choose from {', '.join(CASES)}")
    if "flush" in cases and args.flush_baseline is None:
        parser.error("--cases flush needs --flush-baseline S (the interval to compare the default with)")
    if args.pinned:
        sides = {side for case in cases for side in CASES[case][0]}
        usable = len(os.sched_getaffinity(0))
        if len(sides) > usable:
            parser.error(f"--pinned runs each of the {len(sides)} sides of --cases {','.join(cases)} on cores of "
                         f"its own, but {usable} cores are usable")
        if shutil.which("taskset") is None:
            parser.error("--pinned needs taskset (util-linux) on PATH")

    from dtprobe.collectors.config import CollectConfig

    defaults = CollectConfig()
    print(f"collectors on = defaults: flush_interval_s={defaults.flush_interval_s}, "
          f"close_on_sigterm={defaults.close_on_sigterm}, collective_timing={defaults.collective_timing}, "
          f"devices every {defaults.device_interval_s} s; cases: {', '.join(cases)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="dtprobe-bench-") as tmp:
        cpu_default = bound_thread_cpu(Path(tmp) / "default", interval_s=defaults.flush_interval_s)
        cpu_slow = bound_thread_cpu(Path(tmp) / "slow", interval_s=1.0)
    print(f"bound threads' CPU: {cpu_default * 1e3:.2f} ms per s at flush_interval_s={defaults.flush_interval_s}, "
          f"{cpu_slow * 1e3:.2f} ms per s at 1.0 (difference {(cpu_default - cpu_slow) * 100:.3f}% of one core)",
          flush=True)
    results = run_cases(cases, args)
    print()
    medians = {name: statistics.median(values) for name, values in results.medians.items()}
    if medians:
        print("median step (ms): " + ", ".join(f"{name} {value * 1e3:.2f}" for name, value in medians.items()))
    for case in cases:
        for line in CASES[case][1](results, args):
            print(line)
    mode = ("sides run concurrently" if args.concurrent else
            "sides run at once, each on its own cores (rotated every pair)" if args.pinned else "sides alternated")
    print(f"({args.nproc} ranks x {args.steps} steps per run, {mode}, CPU + gloo on this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
