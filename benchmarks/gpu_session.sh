#!/usr/bin/env bash
# Everything a GPU session needs in one device call: the test suite on CUDA, then the benchmark.
#   bash benchmarks/gpu_session.sh            (writes pytest.log, bench.log, results.md to $OUT or out/)
# FLA comes from a carried wheel when .whl/ holds one (see benchmarks/FLA_NOTES.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${TEST_SECONDS:-240}" python3 -m pytest -q tests 2>&1 | tee "$OUT/pytest.log" | tail -15
timeout "${BENCH_SECONDS:-300}" python3 benchmarks/bench.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -80
