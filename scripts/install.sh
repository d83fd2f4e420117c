#!/usr/bin/env bash
# Installs dtprobe and what it needs on a fresh machine. Usage: bash scripts/install.sh [--dev]
#   --dev  also the test tools (pytest, HTA, Playwright, kaleido) and the Debian packages the tests use (chromium for
#          the browser tests; iproute2 and util-linux for the chaos tests).
# torch is pinned FIRST to the CPU build (2.13.0): a plain `torch` requirement with no torch installed would
# pull a multi-GB CUDA build. On a GPU machine install your CUDA torch (>=2.6) before running this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dev=0
[[ "${1:-}" == "--dev" ]] && dev=1

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[install] torch (CPU build 2.13.0)"
  "$PY" -m pip install -q torch==2.13.0
fi
if [[ $dev == 1 ]]; then
  echo "[install] dtprobe + dev extras"
  "$PY" -m pip install -q -e '.[dev]'
  # Debian packages the tests need: chromium (browser tests, PNG export); iproute2 and util-linux (the chaos
  # tests' network namespaces, tc, unshare, taskset).
  debs=()
  [[ -x /usr/bin/chromium ]] || debs+=(chromium)
  { command -v ip && command -v tc; } >/dev/null 2>&1 || debs+=(iproute2)
  { command -v unshare && command -v taskset; } >/dev/null 2>&1 || debs+=(util-linux)
  if (( ${#debs[@]} )); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
      echo "[install] Debian ${debs[*]}"
      apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${debs[@]}" >/dev/null
    else
      echo "[install] WARNING: missing ${debs[*]} and apt-get unavailable (or not root): browser and chaos tests will fail" >&2
    fi
  fi
else
  echo "[install] dtprobe"
  "$PY" -m pip install -q -e .
fi
# The native collective recorder (collectors/native_recorder.cpp; g++ and ninja): without a compiler or torch's
# headers it is not built, says so, and collectives are recorded in Python; never fatal.
"$PY" -m dtprobe.collectors.native_recorder || echo "[install] WARNING: native recorder not built" >&2
# An editable install leaves the project's modules uncompiled, and with PYTHONDONTWRITEBYTECODE set (as on CI
# machines) every process would compile them again at import: compile them once here, as pip does for wheels.
"$PY" -m compileall -q dtprobe dashboard collectors >/dev/null
echo "[install] done: $("$PY" -c 'import torch; print("torch", torch.__version__)')"
