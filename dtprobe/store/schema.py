"""The run-store contract: table names, column dtypes and units, file layout; read by every writer and reader.

Units live in column names: ``_ns`` (integer nanoseconds; ``*_ns`` timestamps are Unix-epoch nanoseconds on the
writing rank's clock, which the reader shifts onto rank 0's clock), ``_bytes``, ``_frac`` (0..1), ``_w``, ``_c``,
``_mhz``. A column missing from a row is stored as null.
"""

from __future__ import annotations

SCHEMA_VERSION = 3
"""Bumped whenever a column changes meaning or a table changes shape; readers refuse newer versions.
2: ``collectives`` and ``pending`` events rows name their group by ``pg`` only; its members are in ``groups``.
3: compaction writes the per-step tables partitioned by step block and rank block (``PARTITION_FILE``); the events
layout is that of version 2. Compacted runs of versions 1 and 2 (one file per table) are still read."""
OLDEST_SCHEMA_VERSION = 1
"""The oldest version this dtprobe reads: version-1 events rows carry ``pg_ranks``/``pg_size`` themselves."""

MANIFEST_FILE = "run.json"
"""``<run>/run.json``: the manifest, written by the launcher (or the leader rank under ``attach``)."""
RANK_INFO_FILE = "ranks/rank{rank:05d}.json"
"""``<run>/ranks/rankNNNNN.json``: one per rank (host, node rank, local rank, device, clock offset, pid)."""
EVENTS_FILE = "events/{table}/rank{rank:05d}.jsonl"
"""``<run>/events/<table>/rankNNNNN.jsonl``: append-only, one JSON object per line, one file per table and rank."""
COMPACT_FILE = "tables/{table}.parquet"
"""``<run>/tables/<table>.parquet``: all ranks of one table, clock-aligned, written by compaction (the tables
outside ``STEP_TABLES``; every table in compactions of versions 1 and 2)."""
PARTITION_FILE = "tables/{table}/step_block={step_block}/rank_block={rank_block}/part-0.parquet"
"""``<run>/tables/<table>/step_block=K/rank_block=R/part-0.parquet``: a per-step table's rows of steps
``K*STEP_BLOCK_STEPS ..`` (block -1: rows outside steps) and ranks ``R*RANK_BLOCK_RANKS ..``, clock-aligned."""
DERIVED_FILE = "tables/derived/{table}/step_block={step_block}/part-0.parquet"
"""``<run>/tables/derived/<table>/step_block=K/part-0.parquet``: a derived per-step table (computed at compaction
from step block K's rows by the caller's ``store.derived.Deriver``: the analysis' ``lateness``, ``exposure``)."""
STEP_BLOCK_STEPS = 20
"""Steps per step block of a compacted per-step table (a window of N steps reads at most N/20 + 1 blocks)."""
RANK_BLOCK_RANKS = 32
"""Ranks per rank block of a compacted per-step table (worlds up to 32 ranks have one rank block)."""
ROW_GROUP_ROWS = 32768
"""Rows per Parquet row group in partition files: a rank filter skips the row groups of other ranks."""
TRACES_DIR = "traces"
"""``<run>/traces/<window>/rankNNNNN.pt.trace.json.gz``: Kineto traces of profiler windows."""
CHECKPOINTS_DIR = "checkpoints"
"""``<run>/checkpoints/``: DCP checkpoints with commit markers."""

# Column -> dtype (pandas nullable dtypes). "rank" is always present.
SCHEMAS: dict[str, dict[str, str]] = {
    "steps": {
        "rank": "int32", "step": "int64", "start_ns": "int64", "end_ns": "int64",
        "data_ns": "int64", "fwd_ns": "int64", "bwd_ns": "int64", "opt_ns": "int64",
        "loss": "float64", "tokens": "int64", "lr": "float64", "restart": "int32", "clock": "string",
    },
    "collectives": {
        "rank": "int32", "pg": "string", "pg_ranks": "string", "pg_size": "int32", "seq": "int64",
        "op": "string", "num_bytes": "int64", "dtype": "string", "enqueue_ns": "int64",
        "start_ns": "int64", "end_ns": "int64", "step": "int64", "peer": "int32", "timing": "string",
        "restart": "int32", "arrive_ns": "int64",
    },
    "devices": {
        "rank": "int32", "host": "string", "time_ns": "int64", "source": "string", "gpu": "int32",
        "util_frac": "float64", "mem_util_frac": "float64", "mem_used_bytes": "int64",
        "mem_total_bytes": "int64", "power_w": "float64", "power_limit_w": "float64", "temp_c": "float64",
        "sm_clock_mhz": "float64", "throttle_reasons": "int64", "pcie_tx_bytes_per_s": "float64",
        "pcie_rx_bytes_per_s": "float64", "nvlink_tx_bytes_per_s": "float64",
        "nvlink_rx_bytes_per_s": "float64", "xid": "int64", "cpu_frac": "float64", "rss_bytes": "int64",
        "load1": "float64", "step": "int64", "cpu_throttled_ns": "int64", "cpu_wait_ns": "int64",
        "cpu_time_ns": "int64",
    },
    "faults": {
        "rank": "int32", "time_ns": "int64", "step": "int64", "kind": "string", "injected": "boolean",
        "detail": "string",
    },
    "pipeline": {
        "rank": "int32", "stage": "int32", "step": "int64", "microbatch": "int32", "action": "string",
        "start_ns": "int64", "end_ns": "int64", "clock": "string", "restart": "int32",
    },
    "amp": {
        "rank": "int32", "step": "int64", "scale_before": "float64", "scale_after": "float64",
        "found_inf": "boolean", "skipped": "boolean", "restart": "int32",
    },
    "checkpoints": {
        "rank": "int32", "step": "int64", "kind": "string", "start_ns": "int64", "blocking_ns": "int64",
        "async_ns": "int64", "total_ns": "int64", "num_bytes": "int64", "ok": "boolean", "path": "string",
    },
    "memory": {
        "rank": "int32", "step": "int64", "param_bytes": "int64", "grad_bytes": "int64",
        "optim_bytes": "int64", "peak_bytes": "int64", "rss_bytes": "int64", "restart": "int32",
    },
    "compression": {
        "rank": "int32", "step": "int64", "bucket": "int32", "method": "string", "raw_bytes": "int64",
        "sent_bytes": "int64", "encode_ns": "int64", "decode_ns": "int64", "residual_norm": "float64",
        "restart": "int32",
    },
    "kernels": {
        "rank": "int32", "name": "string", "kind": "string", "stream": "int64", "start_ns": "int64",
        "dur_ns": "int64", "step": "int64",
        # added by TRACES (Kineto ingest): CUPTI correlation id and the host time of the launching runtime call
        "correlation": "int64", "launch_ns": "int64",
    },
    # A rank's life as its probe saw it: one "attach" row when the probe starts, one "close" row when it closes
    # (status finished/crashed; reason: "exit", "exception", "SIGTERM", "watchdog", ...). A rank/restart with an
    # "attach" row and no "close" row stopped without closing (killed, frozen or still running).
    "lifecycle": {
        "rank": "int32", "restart": "int32", "time_ns": "int64", "event": "string", "status": "string",
        "reason": "string", "pid": "int64", "step": "int64",
    },
    # Collectives in flight, spilled to disk by the recorder while they are still pending (each at most once), so
    # a rank killed inside a collective leaves a row naming it. A pending row with no ``collectives`` row of the
    # same (rank, restart, pg, pg_ranks, seq, peer, op) never completed.
    "pending": {
        "rank": "int32", "restart": "int32", "pg": "string", "pg_ranks": "string", "pg_size": "int32",
        "seq": "int64", "op": "string", "num_bytes": "int64", "dtype": "string", "enqueue_ns": "int64",
        "step": "int64", "peer": "int32", "timing": "string",
    },
    # One row per process group a rank recorded a collective on, written before the first row that refers to it.
    # Events rows of ``collectives`` and ``pending`` carry only ``pg``, this table's key per (rank, restart); the
    # reader fills their ``pg`` (the group's ``name``), ``pg_ranks`` and ``pg_size`` from it.
    "groups": {
        "rank": "int32", "restart": "int32", "pg": "string", "name": "string", "pg_ranks": "string",
        "pg_size": "int32",
    },
    # Per-step, per-group summaries of a rank's own collectives (``collectors.comm_summaries``), written once the
    # step ended and its collectives completed: one row per (step, group the rank recorded on), ``pg`` a ``groups``
    # key like ``collectives``, and for a step on two or more groups one row with ``pg`` null over all of them
    # (``comm_ns`` the union over them). ``all_groups`` is true on the row that covers all of the step's
    # collectives: that one, or a one-group step's group row; a checkpoint group's (``is_checkpoint_group``) are in
    # none. Collectives and p2p rows of steps >= 0; ``comm_ns``, ``last_end_ns`` and ``longest_ns`` count completed
    # rows only. A collective that completed after its step's rows were written gets a second row of the same key:
    # readers add the counts, bytes and ``comm_ns``.
    "comm_steps": {
        "rank": "int32", "restart": "int32", "step": "int64", "pg": "string", "pg_ranks": "string",
        "pg_size": "int32", "all_groups": "boolean", "num_collectives": "int64", "num_completed": "int64",
        "num_bytes": "int64", "first_enqueue_ns": "int64", "last_enqueue_ns": "int64", "last_end_ns": "int64",
        "comm_ns": "int64", "longest_ns": "int64",
    },
    # Clock offset samples of a rank (rank 0's clock minus the rank's): ``event`` "attach" (the measurement at
    # attach, also in ranks/*.json), "remeasure" (the periodic thread) or "failed" (the thread stopped: offset
    # null, ``detail`` says why). ``time_ns`` is on the rank's own clock and is NOT shifted by the reader: the
    # reader interpolates these samples to align the other tables (``dtprobe.store.clock_sync``).
    "clock": {
        "rank": "int32", "restart": "int32", "time_ns": "int64", "offset_ns": "int64", "rtt_ns": "int64",
        "event": "string", "detail": "string",
    },
}
"""Every table's columns. Collectors write subsets of these; the reader fills the rest with nulls."""

TIME_COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": ("start_ns", "end_ns"),
    "collectives": ("enqueue_ns", "start_ns", "end_ns", "arrive_ns"),
    "devices": ("time_ns",),
    "faults": ("time_ns",),
    "pipeline": ("start_ns", "end_ns"),
    "checkpoints": ("start_ns",),
    "kernels": ("start_ns", "launch_ns"),
    "lifecycle": ("time_ns",),
    "pending": ("enqueue_ns",),
    "comm_steps": ("first_enqueue_ns", "last_enqueue_ns", "last_end_ns"),
}
"""Columns holding a rank-clock timestamp: the reader adds that rank's clock offset to these."""

STEP_TABLES = ("steps", "collectives", "devices", "pipeline", "amp", "memory", "compression", "kernels",
               "comm_steps")
"""Tables with rows every step (their volume grows with the run); the others (faults, checkpoints) hold rare
events. A recent-steps view reads these from the newest steps only."""

CHECKPOINT_GROUP = "ckpt"
"""The name of a checkpoint group (``--ckpt-async`` saves on one; ``probe.new_group(ranks, name="ckpt")`` names a
script's own): its collectives run beside the training steps, so they count in no step figure (``comm_steps``'
``all_groups`` row, the analysis' lateness and exposure)."""


def is_checkpoint_group(pg: str | None) -> bool:
    """Whether a ``pg`` name or ``groups`` key (``<name>#<k>`` for a second group of that name) is a checkpoint
    group's."""
    return pg is not None and (pg == CHECKPOINT_GROUP or pg.startswith(CHECKPOINT_GROUP + "#"))


GROUPED_TABLES = ("collectives", "pending", "comm_steps")
"""Tables whose events rows refer to a ``groups`` row by (rank, restart, pg) instead of repeating its members."""
FLUSH_FIRST = ("groups",)
"""Tables a rank's writer hands to the OS before any other at every flush: rows of other tables refer to them, so
a rank killed mid-flush never leaves a row whose group row is lost."""

RUN_STATUSES = ("running", "finished", "crashed")
