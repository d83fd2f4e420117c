#!/usr/bin/env bash
# Regenerates the data-parallel scenarios: dp4_clean/ and dp4_straggler_rank2/, made by `dtprobe run`.
# Each keeps run.json, ranks/ and the compacted tables/ (the events files are dropped after compaction: the
# Parquet tables hold every row). Usage: bash sample_traces/make_spine.sh
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=1
slim() { rm -rf "$1/events" "$1/logs"; }
keep_readme() { mkdir -p "$1.readme" && mv "$1/README.md" "$1.readme/" && rm -rf "$1"; }
put_readme() { mv "$1.readme/README.md" "$1/" && rmdir "$1.readme"; }
keep_readme dp4_clean; keep_readme dp4_straggler_rank2
dtprobe run --nproc 4 --steps 30 --run-dir dp4_clean --device-interval 0.5
slim dp4_clean
dtprobe run --nproc 4 --steps 30 --run-dir dp4_straggler_rank2 --device-interval 0.5 \
  --inject straggler:rank=2,delay_ms=200
slim dp4_straggler_rank2
put_readme dp4_clean; put_readme dp4_straggler_rank2
du -sh dp4_clean dp4_straggler_rank2
