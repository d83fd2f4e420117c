"""Which engine reads a compacted run's partitioned Parquet fastest: pyarrow.dataset with filters, DuckDB over the
Parquet files, or Polars ``scan_parquet``; the measurement behind the store's choice (issue 17, item 2).

Writes one synthetic ``collectives`` table (tp8 x dp layout: 60 collectives per step and rank on tp groups, 40 on dp
groups; default 64 ranks x 200 steps x 100 = 1.28 M rows) with the store's own partition writer
(``dtprobe.store.partitions.write_partitions``) into a temporary folder, then times, median of ``--repeat`` runs,
each engine on three queries, every answer as an Arrow table: the last 20 steps of all ranks, one rank's rows, and
per (rank, step) the number of collectives and the latest enqueue. ``store`` is what ``RunStore`` does (files picked
from the marker's ranges, then ``pyarrow.dataset`` filters inside them). The answers of all engines are checked
equal before any time is printed. DuckDB and Polars are optional: a missing one is reported and skipped.

    python benchmarks/store_engines.py [--ranks 64 --steps 200 --collectives 100 --repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtprobe.store.frames import arrow_schema  # noqa: E402
from dtprobe.store.partitions import read_files, row_filter, write_partitions  # noqa: E402

WINDOW_STEPS = 20
ONE_RANK = 37


def collectives(num_ranks: int, num_steps: int, per_step: int) -> pa.Table:
    """Sorted (rank, enqueue_ns, seq) rows of a tp8 x dp job: 60% of each step's collectives on the tp group."""
    tp = 8
    n = num_ranks * num_steps * per_step
    rank = np.repeat(np.arange(num_ranks, dtype=np.int32), num_steps * per_step)
    step = np.tile(np.repeat(np.arange(num_steps, dtype=np.int64), per_step), num_ranks)
    k = np.tile(np.arange(per_step, dtype=np.int64), num_ranks * num_steps)
    on_tp = k < per_step * 6 // 10
    rng = np.random.default_rng(0)
    enqueue = 1_700_000_000_000_000_000 + step * 100_000_000 + k * 900_000 + rng.integers(0, 50_000, n)
    end = enqueue + rng.integers(20_000, 400_000, n)
    tp_group = rank // tp
    dp_group = rank % tp
    members_tp = [",".join(map(str, range(g * tp, g * tp + tp))) for g in range(num_ranks // tp)]
    members_dp = [",".join(map(str, range(g, num_ranks, tp))) for g in range(tp)]
    pg_ranks = np.where(on_tp, np.array(members_tp, dtype=object)[tp_group],
                        np.array(members_dp, dtype=object)[dp_group])
    seq = np.where(on_tp, step * (per_step * 6 // 10) + k, step * (per_step - per_step * 6 // 10)
                   + k - per_step * 6 // 10) + 1
    columns = {
        "rank": rank, "pg": np.where(on_tp, "tp", "dp"), "pg_ranks": pg_ranks,
        "pg_size": np.where(on_tp, tp, num_ranks // tp).astype(np.int32), "seq": seq,
        "op": np.where(on_tp, "all_gather", "reduce_scatter"), "num_bytes": np.full(n, 4 << 20, dtype=np.int64),
        "dtype": np.full(n, "bfloat16"), "enqueue_ns": enqueue, "start_ns": enqueue, "end_ns": end, "step": step,
        "timing": np.full(n, "host"), "restart": np.zeros(n, dtype=np.int32),
    }
    schema = arrow_schema("collectives")
    arrays = [pa.array(columns[f.name], type=f.type) if f.name in columns else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _timed(fn, repeat: int) -> tuple[float, pa.Table]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _canon(t: pa.Table, keys: list[str]) -> pa.Table:
    return t.select(sorted(t.column_names)).sort_by([(k, "ascending") for k in keys])


def engines(root: Path, files, ordered: bool, first: int, last: int) -> dict[str, dict[str, callable]]:
    glob = str(root / "collectives" / "**" / "*.parquet")
    window, one = (first, last), frozenset({ONE_RANK})

    def arrow_dataset():
        return ds.dataset(root / "collectives", format="parquet", partitioning="hive",
                          schema=arrow_schema("collectives"))

    def arrow_groupby(t: pa.Table) -> pa.Table:
        out = t.group_by(["rank", "step"]).aggregate([("seq", "count"), ("enqueue_ns", "max")])
        return out.rename_columns(["rank", "step", "num_collectives", "max_enqueue_ns"])

    out = {
        "store": {
            "window": lambda: read_files(root, [f for f in files if f.may_hold(window, None)], "collectives",
                                         row_filter(window, None), ordered=ordered),
            "one rank": lambda: read_files(root, [f for f in files if f.may_hold(None, one)], "collectives",
                                           row_filter(None, one), ordered=ordered),
            "group-by": lambda: arrow_groupby(read_files(root, files, "collectives", None, ordered=ordered)
                                              .select(["rank", "step", "seq", "enqueue_ns"])),
        },
        "pyarrow.dataset": {
            "window": lambda: arrow_dataset().to_table(filter=(pc.field("step") >= first) & (pc.field("step") <= last)),
            "one rank": lambda: arrow_dataset().to_table(filter=pc.field("rank") == ONE_RANK),
            "group-by": lambda: arrow_groupby(arrow_dataset().to_table(columns=["rank", "step", "seq", "enqueue_ns"])),
        },
    }
    try:
        import duckdb
    except ImportError:
        print("duckdb is not installed: skipped (pip install duckdb)")
    else:
        src = f"read_parquet('{glob}', hive_partitioning = false)"
        con = duckdb.connect()
        out["duckdb"] = {
            "window": lambda: con.sql(f"SELECT * FROM {src} WHERE step BETWEEN {first} AND {last}").to_arrow_table(),
            "one rank": lambda: con.sql(f"SELECT * FROM {src} WHERE rank = {ONE_RANK}").to_arrow_table(),
            "group-by": lambda: con.sql(f"SELECT rank, step, count(seq) AS num_collectives, max(enqueue_ns) AS "
                                        f"max_enqueue_ns FROM {src} GROUP BY rank, step").to_arrow_table(),
        }
    try:
        import polars as pl
    except ImportError:
        print("polars is not installed: skipped (pip install polars)")
    else:
        def scan():
            return pl.scan_parquet(glob, hive_partitioning=False)
        out["polars"] = {
            "window": lambda: scan().filter(pl.col("step").is_between(first, last)).collect().to_arrow(),
            "one rank": lambda: scan().filter(pl.col("rank") == ONE_RANK).collect().to_arrow(),
            "group-by": lambda: scan().group_by(["rank", "step"]).agg(
                pl.col("seq").count().alias("num_collectives"),
                pl.col("enqueue_ns").max().alias("max_enqueue_ns")).collect().to_arrow(),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--collectives", type=int, default=100, help="collectives per step and rank")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    table = collectives(args.ranks, args.steps, args.collectives)
    first, last = args.steps - WINDOW_STEPS, args.steps - 1
    with tempfile.TemporaryDirectory(prefix="dtprobe-engines-") as tmp:
        root = Path(tmp) / "tables"
        t0 = time.perf_counter()
        files, ordered = write_partitions(table, root, "collectives", {"dtprobe.schema_version": "3"})
        size = sum(p.stat().st_size for p in root.rglob("*.parquet"))
        print(f"{table.num_rows:,} rows ({args.ranks} ranks x {args.steps} steps x {args.collectives}) written as "
              f"{len(files)} partition files, {size / 1e6:.1f} MB, in {time.perf_counter() - t0:.2f} s "
              f"(ordered: {ordered})", flush=True)
        runs = engines(root, files, ordered, first, last)
        results: dict[str, dict[str, float]] = {}
        answers: dict[str, dict[str, pa.Table]] = {}
        for engine, queries in runs.items():
            print(f"  {engine} ...", flush=True)
            results[engine], answers[engine] = {}, {}
            for query, fn in queries.items():
                results[engine][query], answers[engine][query] = _timed(fn, args.repeat)
        keys = {"window": ["rank", "enqueue_ns", "seq"], "one rank": ["rank", "enqueue_ns", "seq"],
                "group-by": ["rank", "step"]}
        for query, k in keys.items():
            ref = answers["store"][query]
            cols = ref.column_names
            for engine in answers:
                got = answers[engine][query].select(cols)
                same = _canon(got.cast(ref.schema), k).equals(_canon(ref, k))
                if not same:
                    print(f"MISMATCH: {engine} {query}: {got.num_rows} rows vs store {ref.num_rows}")
                    return 1
        print(f"\n{'engine':<18}" + "".join(f"{q:>12}" for q in keys) + "   (median s; ratio to store)")
        for engine, row in results.items():
            print(f"{engine:<18}" + "".join(f"{row[q]:>7.3f} {row[q] / results['store'][q]:>4.1f}x" for q in keys))
        print(f"\nrows: window {answers['store']['window'].num_rows:,}, one rank "
              f"{answers['store']['one rank'].num_rows:,}, groups {answers['store']['group-by'].num_rows:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
