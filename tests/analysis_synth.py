"""The analysis tests' name for ``dtprobe.synthetic`` (synthetic runs with known answers): its public names,
re-exported so that ``from analysis_synth import dp_tables`` keeps working."""

from dtprobe.synthetic import (  # noqa: F401
    MS, T0, DataParallelTimeline, SyntheticRun, cut_rank, dp_pp_tables, dp_stall_tables, dp_tables, frames,
    lockstep_tables, pending_row, pipeline_tables, sampler_rows, stall_rank, write_rows_run, write_run,
    write_synthetic_run)
