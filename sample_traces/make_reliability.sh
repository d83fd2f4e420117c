#!/usr/bin/env bash
# Regenerates the reliability scenarios: fp16_overflow/, hang_rank1/, ckpt_crash_restart/,
# topk_vs_baseline/{baseline,topk}/, made by `dtprobe run` on CPU/gloo (2 or 4 ranks, tiny GPT, batch 2 x 16 tokens).
# Each keeps run.json, job.json, ranks/ and the compacted tables/ (events/ dropped after compaction; checkpoints/
# dropped: 22 MB); the crash and hang scenarios keep logs/ (torchrun and worker output, the watchdog's message).
# Usage: bash sample_traces/make_reliability.sh   (from the repository root, on an otherwise quiet machine)
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=1
C=(--no-devices --batch-size 2 --seq-len 16)
slim() { rm -rf "$1/events" "$1/checkpoints"; if [ "${2:-}" != keep-logs ]; then rm -rf "$1/logs"; fi; }
rm -rf fp16_overflow hang_rank1 ckpt_crash_restart topk_vs_baseline
dtprobe run --run-dir fp16_overflow --nproc 2 --steps 14 --precision fp16 --inject overflow:step=10,rank=1 "${C[@]}"
slim fp16_overflow
dtprobe run --run-dir hang_rank1 --nproc 2 --steps 12 --collective-timeout 8 --inject hang:rank=1,step=5 \
  --device-interval 0.5 --batch-size 2 --seq-len 16 \
  || true   # ends crashed by design (exit 1): the watchdog exits with 124 and there are no restarts
slim hang_rank1 keep-logs
dtprobe run --run-dir ckpt_crash_restart --nproc 2 --steps 30 --ckpt-every 5 --max-restarts 1 \
  --inject crash:rank=1,step=15 "${C[@]}"
slim ckpt_crash_restart keep-logs
dtprobe run --run-dir topk_vs_baseline/baseline --nproc 4 --steps 50 "${C[@]}"
dtprobe run --run-dir topk_vs_baseline/topk --nproc 4 --steps 50 --compress topk:ratio=0.01 "${C[@]}"
slim topk_vs_baseline/baseline
slim topk_vs_baseline/topk
du -sh fp16_overflow hang_rank1 ckpt_crash_restart topk_vs_baseline
