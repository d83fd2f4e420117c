"""Run ``kineto_reduce.reduce_trace_file`` over a folder's files: in this process, in a local process pool, or on
an existing Dask cluster; read by ``kineto.load_trace_dir``.

Each worker holds one file's reduction at a time and hands back only the rank's tables, which ``keep`` turns into
what the caller holds (``kineto_spill`` writes them to disk) as each arrives: peak memory is about the largest
file's working set times the number of workers, not the size of the folder. Every mode returns the kept results in
the order of ``files``; an error in one rank's file is a TraceError naming that file, never a worker traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtprobe.store.errors import ConfigError, TraceError
from dtprobe.store.kineto_reduce import RankTables, reduce_trace_file

ProgressFn = Callable[[int, int, str], None]
"""``progress(done, total, path)``, called after each file is reduced."""
KeepFn = Callable[[RankTables], Any]
"""``keep(tables)``: what to hold of a rank's tables once they arrive (the tables themselves by default)."""


def _as_is(tables: RankTables) -> RankTables:
    return tables

DASK_CONNECT_TIMEOUT_S = 10.0
"""How long to wait for the Dask scheduler at ``--dask ADDRESS`` to answer."""


def default_workers() -> int:
    """One worker per CPU this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(kw_only=True, frozen=True)
class ReduceConfig:
    """Where the per-rank reduction of a trace folder runs."""

    workers: int | None = None
    """Local worker processes (1: in this process); None: one per CPU, at most one per file."""
    dask_address: str | None = None
    """Scheduler of an existing Dask cluster (``tcp://host:8786``) to run the reduction on instead; its workers
    must read the trace files at the same paths."""

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers {self.workers}: must be at least 1 (1 reads the files in this process).")
        if self.dask_address is not None and not self.dask_address.strip():
            raise ConfigError("--dask: empty address; give the scheduler's, e.g. tcp://127.0.0.1:8786.")
        if self.dask_address is not None and self.workers is not None:
            warnings.warn(f"--workers {self.workers} has no effect with --dask: the Dask cluster's workers reduce "
                          f"the files.", stacklevel=2)


def reduce_files(files: list[Path], config: ReduceConfig, *, progress: ProgressFn | None = None,
                 keep: KeepFn = _as_is) -> list[Any]:
    """``keep`` of every file's ``RankTables`` (the tables themselves by default), in the order of ``files``; each
    rank's tables are dropped once ``keep`` returns."""
    single_file = len(files) == 1
    if config.dask_address is not None:
        return _on_dask(files, config.dask_address, single_file=single_file, progress=progress, keep=keep)
    workers = min(config.workers or default_workers(), len(files))
    if workers <= 1:
        results = []
        for done, path in enumerate(files, 1):
            results.append(keep(reduce_trace_file(str(path), single_file=single_file)))
            if progress:
                progress(done, len(files), str(path))
        return results
    return _in_pool(files, workers, progress=progress, keep=keep)


def _init_worker() -> None:
    """Ctrl-C is the parent's to handle (it cancels the pool), so workers ignore SIGINT instead of each printing a
    traceback; SIGTERM keeps its default so shutting the pool down always ends them."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _pool_context() -> mp.context.BaseContext:
    """forkserver where available (a fork of a clean server process: the caller's threads, e.g. a dashboard's,
    and their locks are not copied), else spawn; the server imports the reduction once."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["dtprobe.store.kineto_reduce"])
        return ctx
    return mp.get_context("spawn")


def _in_pool(files: list[Path], workers: int, *, progress: ProgressFn | None, keep: KeepFn) -> list[Any]:
    results: list[Any] = [None] * len(files)
    with ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context(), initializer=_init_worker) as pool:
        futures: dict[Future, int] = {pool.submit(reduce_trace_file, str(path), single_file=False): i
                                      for i, path in enumerate(files)}
        try:
            for done, future in enumerate(as_completed(futures), 1):
                index = futures.pop(future)      # the future holds the rank's tables until it is dropped
                results[index] = keep(_result(future.result, files[index]))
                if progress:
                    progress(done, len(files), str(files[index]))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return [r for r in results if r is not None]


def _result(get: Callable[[], RankTables], path: Path) -> RankTables:
    """A worker's result; its error as a TraceError naming the file, without the worker's traceback."""
    try:
        return get()
    except TraceError as exc:
        raise TraceError(str(exc)) from None
    except BrokenProcessPool:
        raise TraceError(
            f"{path}: a worker process died while this file was being reduced (killed, or out of memory). Each "
            f"worker holds one file's reduction: retry with fewer --workers, or --workers 1.") from None
    except Exception as exc:   # any other failure of the worker (a Dask worker lost, a bug): name the file
        raise TraceError(f"{path}: reducing the trace failed in a worker ({type(exc).__name__}: {exc}). Retry with "
                         f"--workers 1 to see it in this process, and report it with the file if it persists.") \
            from None


def _on_dask(files: list[Path], address: str, *, single_file: bool, progress: ProgressFn | None,
             keep: KeepFn) -> list[Any]:
    try:
        from dask.distributed import Client
        from dask.distributed import as_completed as dask_completed
    except ImportError:
        raise ConfigError(
            "--dask needs dask.distributed, which is not installed: pip install 'dtprobe[dask]' (or "
            "'dask[distributed]>=2024.1'), or leave out --dask to reduce the files with local --workers.") from None
    try:
        client = Client(address, timeout=DASK_CONNECT_TIMEOUT_S, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as exc:
        raise ConfigError(
            f"--dask {address}: no Dask scheduler answers there ({exc}). Start one with `dask scheduler --host "
            f"127.0.0.1 --port 8786` and workers with `dask worker tcp://127.0.0.1:8786` on machines that see the "
            f"trace files at the same paths, then pass --dask tcp://127.0.0.1:8786; or leave out --dask to use "
            f"local --workers.") from None
    results: list[Any] = [None] * len(files)
    with client:
        paths = [str(path.resolve()) for path in files]
        futures = client.map(reduce_trace_file, paths, single_file=single_file, pure=False)
        index = {future.key: i for i, future in enumerate(futures)}
        try:
            for done, future in enumerate(dask_completed(futures, loop=client.loop), 1):
                i = index[future.key]
                results[i] = keep(_result(future.result, files[i]))
                future.release()         # the worker may forget the rank's tables: they are kept here
                if progress:
                    progress(done, len(files), str(files[i]))
        except BaseException:
            client.cancel(futures)
            raise
    return [r for r in results if r is not None]
