#!/usr/bin/env bash
# Everything a GPU session needs in one device call: the test suite on CUDA, then the benchmark.
#   bash benchmarks/gpu_session.sh     (writes gpu.txt, pytest.log, bench.log, results.md to $OUT or out/)
# Environment: SHARDS (parallel pytest processes, default 8: on the H200 host the suite's time is
# mostly single-threaded kernel compiles), TEST_SECONDS / BENCH_SECONDS (limits; 0 skips the step),
# BENCH_ARGS (arguments for bench.py, e.g. "--parts fwd,decode --no-fla").
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
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
SHARDS=${SHARDS:-8}
if [ "${TEST_SECONDS:-300}" != 0 ]; then
    start=$(date +%s)
    for i in $(seq 0 $((SHARDS - 1))); do
        timeout "${TEST_SECONDS:-300}" python3 -m pytest -q -p no:cacheprovider --durations=5 \
            --shard "$i/$SHARDS" tests > "$OUT/pytest.$i.log" 2>&1 &
    done
    wait
    cat "$OUT"/pytest.*.log > "$OUT/pytest.log"
    echo "tests: $(( $(date +%s) - start )) s"
    grep -hE "passed|failed|error" "$OUT"/pytest.*.log | grep -E "^(=|[0-9])" | tail -n "$SHARDS"
    grep -hE "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30
fi
if [ "${BENCH_SECONDS:-300}" != 0 ]; then
    timeout "${BENCH_SECONDS:-300}" python3 benchmarks/bench.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench.log" | tail -100
fi
